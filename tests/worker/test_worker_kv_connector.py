"""The worker's KV connector moves exact block bytes between the cache and the kvstore.

Loads report how many leading blocks arrived intact; saves are snapshots taken
before anything in the step can overwrite them; a slow or failing store never
fails a step nor grows memory without bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransfer,
    SchedulerOutput,
)
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.kv_connector import KVConnectorWorker, leading_intact_blocks
from kvmesh.worker.kv_layout import KVBlockCodec, worker_kv_layout
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from tests.worker.kv_connector_helpers import (
    InMemoryKVBlockStore,
    block_bits,
    block_hashes,
    connector_step,
    drain,
    loop_thread,
    random_kv_caches,
    same_bits,
    settle,
)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    with loop_thread() as running:
        yield running


@pytest.fixture
def store() -> InMemoryKVBlockStore:
    return InMemoryKVBlockStore()


def _metric(name: str, reason: str | None = None) -> float:
    labels = {} if reason is None else {"reason": reason}
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_bytes_are_each_layers_keys_then_values(dtype: torch.dtype) -> None:
    caches = random_kv_caches(dtype)
    codec = KVBlockCodec(caches)
    [data] = codec.read_blocks([5])
    expected = b"".join(
        cache[5].contiguous().view(torch.uint8).numpy().tobytes()
        for layer in caches
        for cache in layer
    )
    assert data == expected
    assert codec.block_bytes == len(expected) == 3 * 2 * 4 * 2 * 8 * dtype.itemsize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_round_trip_bitwise_through_the_store_into_another_cache(
    dtype: torch.dtype, loop, store
) -> None:
    source = random_kv_caches(dtype, seed=1)
    target = random_kv_caches(dtype, seed=2)
    untouched = block_bits(target, 1)
    saver = KVConnectorWorker(source, store, loop)
    loader = KVConnectorWorker(target, store, loop)
    hashes = block_hashes("prompt", 3)

    saved = settle(saver, connector_step(saver, saves=[KVTransfer("r", [6, 1, 4], hashes)]))
    assert saved.saved_block_hashes == hashes

    assert connector_step(loader, loads=[KVTransfer("r", [0, 7, 3], hashes)]).finished_loads == {}
    drain(loader)
    assert connector_step(loader).finished_loads == {"r": 3}
    for source_block, target_block in [(6, 0), (1, 7), (4, 3)]:
        assert same_bits(block_bits(target, target_block), block_bits(source, source_block))
    assert same_bits(block_bits(target, 1), untouched)


def test_leading_intact_blocks_stop_at_the_first_missing_or_wrongly_sized_block() -> None:
    good = b"x" * 4
    assert leading_intact_blocks([good, good], 2, 4) == (2, None)
    assert leading_intact_blocks([good, None, good], 3, 4) == (1, "missing")
    assert leading_intact_blocks([good, b"x" * 3, good], 3, 4) == (1, "corrupt")
    assert leading_intact_blocks([good, b"x" * 5], 2, 4) == (1, "corrupt")
    assert leading_intact_blocks([good], 3, 4) == (1, "missing")  # short answer


def _stored_source(store: InMemoryKVBlockStore, loop, count: int) -> tuple[list, list[bytes]]:
    """A cache whose first ``count`` blocks are in the store; (cache, hashes)."""
    source = random_kv_caches(torch.float32, seed=3)
    saver = KVConnectorWorker(source, store, loop)
    hashes = block_hashes("stored", count)
    connector_step(saver, saves=[KVTransfer("s", list(range(count)), hashes)])
    drain(saver)
    return source, hashes


def _load(connector: KVConnectorWorker, block_ids: list[int], hashes: list[bytes]) -> int:
    connector_step(connector, loads=[KVTransfer("r", block_ids, hashes)])
    drain(connector)
    return connector_step(connector).finished_loads["r"]


def test_a_missing_block_ends_the_load_and_later_blocks_stay_untouched(loop, store) -> None:
    source, hashes = _stored_source(store, loop, 4)
    del store.blocks[hashes[2]]
    target = random_kv_caches(torch.float32, seed=4)
    before = block_bits(target, 3)
    failures = _metric("kvmesh:kv_connector_load_failures_total", "missing")
    loader = KVConnectorWorker(target, store, loop)

    assert _load(loader, [4, 5, 6, 3], hashes) == 2
    assert same_bits(block_bits(target, 5), block_bits(source, 1))
    # Block 3 of the store is intact but comes after the gap: never written.
    assert same_bits(block_bits(target, 3), before)
    assert _metric("kvmesh:kv_connector_load_failures_total", "missing") == failures + 2


def test_a_corrupt_block_ends_the_load(loop, store) -> None:
    _, hashes = _stored_source(store, loop, 3)
    store.blocks[hashes[1]] += b"\0"
    loader = KVConnectorWorker(random_kv_caches(torch.float32), store, loop)
    assert _load(loader, [0, 1, 2], hashes) == 1


def test_store_errors_and_timeouts_load_nothing_and_never_fail_the_step(
    loop, store, caplog: pytest.LogCaptureFixture
) -> None:
    _, hashes = _stored_source(store, loop, 2)
    target = random_kv_caches(torch.float32, seed=5)
    before = block_bits(target, 0)
    loader = KVConnectorWorker(target, store, loop, load_timeout_s=0.05)
    store.error = ConnectionError("kvstore down")
    with caplog.at_level(logging.WARNING, logger="kvmesh.worker.kv_connector"):
        assert _load(loader, [0, 1], hashes) == 0
        assert _load(loader, [0, 1], hashes) == 0
    # One warning for a kind of failure, however often it repeats.
    assert [r.getMessage().count("kvstore down") for r in caplog.records] == [1]
    store.error = None
    store.get_delay_s = 0.5
    timeouts = _metric("kvmesh:kv_connector_load_failures_total", "timeout")
    assert _load(loader, [0, 1], hashes) == 0
    assert _metric("kvmesh:kv_connector_load_failures_total", "timeout") == timeouts + 2
    assert same_bits(block_bits(target, 0), before)


def test_a_failed_save_is_counted_and_not_reported_as_saved(loop, store) -> None:
    saver = KVConnectorWorker(random_kv_caches(torch.float32), store, loop)
    store.error = ConnectionError("kvstore down")
    failures = _metric("kvmesh:kv_connector_save_failures_total", "store_error")
    output = settle(
        saver, connector_step(saver, saves=[KVTransfer("r", [0, 1], block_hashes("r", 2))])
    )
    assert output.saved_block_hashes == [] and output.failed_save_hashes == block_hashes("r", 2)
    assert _metric("kvmesh:kv_connector_save_failures_total", "store_error") == failures + 2
    assert saver.inflight_save_bytes == 0


def test_a_block_saved_and_loaded_over_in_one_step_is_saved_with_its_old_bytes(loop, store) -> None:
    cache = random_kv_caches(torch.float32, seed=6)
    [old_bytes] = KVBlockCodec(cache).read_blocks([2])
    [old_hash, new_hash] = block_hashes("x", 2)
    new_bytes = KVBlockCodec(random_kv_caches(torch.float32, seed=7)).read_blocks([0])[0]
    store.blocks[new_hash] = new_bytes
    connector = KVConnectorWorker(cache, store, loop)
    # The load's bytes arrive between steps ...
    connector_step(connector, loads=[KVTransfer("loading", [2], [new_hash])])
    drain(connector)
    # ... and the next step both saves block 2 and writes the load into it.
    output = connector_step(connector, saves=[KVTransfer("saving", [2], [old_hash])])
    drain(connector)
    assert output.finished_loads == {"loading": 1}
    assert connector.codec.read_blocks([2]) == [new_bytes] != [old_bytes]
    assert store.blocks[old_hash] == old_bytes


def test_the_load_of_a_dropped_request_is_never_written(loop, store) -> None:
    _, hashes = _stored_source(store, loop, 1)
    target = random_kv_caches(torch.float32, seed=8)
    before = block_bits(target, 5)
    loader = KVConnectorWorker(target, store, loop)
    connector_step(loader, loads=[KVTransfer("aborted", [5], hashes)])
    drain(loader)
    # Its blocks may be reused by the very step that drops it.
    output = connector_step(loader, finished_req_ids=["aborted"])
    assert output.finished_loads == {}
    assert same_bits(block_bits(target, 5), before)


def test_saves_beyond_the_in_flight_byte_bound_are_dropped_and_counted(loop, store) -> None:
    caches = random_kv_caches(torch.float32)
    block_bytes = KVBlockCodec(caches).block_bytes
    saver = KVConnectorWorker(caches, store, loop, max_inflight_save_bytes=2 * block_bytes + 1)
    gate = asyncio.Event()
    store.put_gate = gate
    hashes = block_hashes("bounded", 5)
    dropped = _metric("kvmesh:kv_connector_save_failures_total", "backpressure")

    first = connector_step(saver, saves=[KVTransfer("r", [0, 1, 2], hashes[:3])])
    assert first.failed_save_hashes == hashes[2:3]  # named, so a wait for it can end
    assert saver.inflight_save_bytes == 2 * block_bytes
    dropped_second = connector_step(saver, saves=[KVTransfer("r", [3], hashes[3:4])])
    assert dropped_second.failed_save_hashes == hashes[3:4]
    assert _metric("kvmesh:kv_connector_save_failures_total", "backpressure") == dropped + 2

    loop.call_soon_threadsafe(gate.set)
    drain(saver)
    assert saver.inflight_save_bytes == 0
    assert connector_step(saver).saved_block_hashes == hashes[:2]
    last = settle(saver, connector_step(saver, saves=[KVTransfer("r", [4], hashes[4:])]))
    assert last.saved_block_hashes == hashes[4:]


def test_transfers_naming_blocks_outside_the_cache_fail_alone(loop, store) -> None:
    connector = KVConnectorWorker(random_kv_caches(torch.float32), store, loop)
    output = connector_step(
        connector,
        loads=[KVTransfer("bad-load", [99], block_hashes("b", 1))],
        saves=[
            KVTransfer("bad-save", [0, 1], block_hashes("b", 1)),
            KVTransfer("good-save", [2], block_hashes("g", 1)),
        ],
    )
    assert output.finished_loads == {"bad-load": 0}
    assert output.failed_save_hashes == block_hashes("b", 1)  # the hash the bad transfer named
    assert settle(connector, output).saved_block_hashes == block_hashes("g", 1)


def test_layout_changes_with_every_layout_fact() -> None:
    base = dict(
        model_name="m",
        dtype=torch.float32,
        block_size=16,
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        tp_rank=0,
        tp_size=1,
    )
    layout = worker_kv_layout(**base)
    assert worker_kv_layout(**base).namespace == layout.namespace
    assert layout.dtype == "float32" and layout.layout_version == 1
    changes = dict(
        model_name="n",
        dtype=torch.bfloat16,
        block_size=32,
        num_layers=31,
        num_kv_heads=4,
        head_dim=128,
        tp_rank=1,
        tp_size=2,
    )
    for name, value in changes.items():
        changed = {**base, name: value}
        if name == "tp_rank":
            changed["tp_size"] = 2  # rank 1 needs two ranks
        assert worker_kv_layout(**changed).namespace != layout.namespace, name
    two_ranks = worker_kv_layout(**{**base, "tp_size": 2})
    assert worker_kv_layout(**{**base, "tp_size": 2, "tp_rank": 1}).namespace != (
        two_ranks.namespace
    )


# ---- the real model ---------------------------------------------------------

BLOCK_SIZE = 16
NUM_PROMPT_BLOCKS = 4
MAX_NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def _runner(model_path: Path) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(model_path, max_model_len=256),
        CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=16),
        num_threads=1,
    )


def _step(
    runner: ModelRunner,
    loads: list[KVTransfer] | None = None,
    saves: list[KVTransfer] | None = None,
) -> KVConnectorOutput:
    """An empty step (no request runs) that carries connector work."""
    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.kv_connector_metadata = KVConnectorMetadata(loads or [], saves or [])
    return runner.execute_model(scheduler_output).kv_connector_output


@pytest.mark.model
def test_a_second_runner_continues_from_loaded_blocks_exactly(
    model_path: Path, prompts: list[list[int]], loop, store
) -> None:
    # 4 full blocks and one more token, whose logits the second runner computes.
    prompt = [token for p in prompts for token in p][: NUM_PROMPT_BLOCKS * BLOCK_SIZE + 1]
    hashes = block_hashes("smollm2-prompt", NUM_PROMPT_BLOCKS)

    first = _runner(model_path)
    first.kv_connector = KVConnectorWorker(first.kv_caches, store, loop)
    assert first.kv_connector.block_bytes == 30 * 2 * 16 * 3 * 64 * 4  # the design's figure
    driver = LocalDriver(first, free_on_finish=False)
    driver.add_request("first", prompt, GREEDY, MAX_NEW_TOKENS)
    finished = driver.run()["first"]
    assert finished.error is None
    saved_blocks = finished.block_ids[:NUM_PROMPT_BLOCKS]
    saving = _step(first, saves=[KVTransfer("first", saved_blocks, hashes)])
    drain(first.kv_connector)
    assert saving.saved_block_hashes + _step(first).saved_block_hashes == hashes

    second = _runner(model_path)
    second.kv_connector = KVConnectorWorker(second.kv_caches, store, loop)
    loaded_blocks = [9, 3, 12, 6]
    _step(second, loads=[KVTransfer("second", loaded_blocks, hashes)])
    drain(second.kv_connector)
    assert _step(second).finished_loads == {"second": NUM_PROMPT_BLOCKS}
    for saved, loaded in zip(saved_blocks, loaded_blocks, strict=True):
        assert same_bits(block_bits(second.kv_caches, loaded), block_bits(first.kv_caches, saved))

    driver = LocalDriver(second)
    request = driver.add_request(
        "second",
        prompt,
        GREEDY,
        MAX_NEW_TOKENS,
        prefix_block_ids=loaded_blocks,
        num_computed_tokens=NUM_PROMPT_BLOCKS * BLOCK_SIZE,
    )
    step = driver.build_step()
    assert step.num_scheduled_tokens == {"second": 1}  # only the last prompt token
    driver.apply_output(step, second.execute_model(step))
    driver.run()
    assert request.error is None
    assert request.output_token_ids == finished.output_token_ids
    assert len(request.output_token_ids) == MAX_NEW_TOKENS
