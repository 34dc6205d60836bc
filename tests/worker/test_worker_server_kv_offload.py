"""The worker service with KV offload: layout key in WorkerInfo, connector work over the wire."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protos import worker_pb2
from services.config import WorkerConfig
from tests.worker.kv_connector_helpers import (
    InMemoryKVBlockStore,
    block_hashes,
    drain,
    loop_thread,
)
from worker.kv_layout import kv_layout_key
from worker.server import WorkerServicer, attach_kv_connector, build_runner

from .conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_checkpoint(folder, "LlamaForCausalLM", torch.float32)
    return folder


def test_step_requests_carry_saves_and_results_report_them(checkpoint: Path) -> None:
    config = WorkerConfig(
        model=str(checkpoint), block_size=4, num_kv_blocks=16, num_threads=1, kv_offload=True
    )
    runner, info = build_runner(config)
    assert info.kv_layout_key == b""  # no connector yet
    store = InMemoryKVBlockStore()
    hashes = block_hashes("wire", 2)
    with loop_thread() as loop:
        connector = attach_kv_connector(runner, info, store, loop)
        model = runner.model_config
        expected_key = kv_layout_key(
            checkpoint.name, model.dtype, 4, model.num_layers, model.num_kv_heads, model.head_dim
        )
        assert info.kv_layout_key == connector.layout_key == expected_key
        servicer = WorkerServicer()
        servicer.attach(runner, info)
        saves = worker_pb2.KVConnectorMetadata(
            saves=[worker_pb2.KVTransfer(req_id="r", block_ids=[3, 5], block_hashes=hashes)]
        )
        first = servicer._run_step(worker_pb2.StepRequest(step_id=1, kv_connector_metadata=saves))
        drain(connector)
        second = servicer._run_step(worker_pb2.StepRequest(step_id=2))
    reported = [
        *first.kv_connector_output.saved_block_hashes,
        *second.kv_connector_output.saved_block_hashes,
    ]
    assert reported == hashes
    assert set(store.blocks) == {(expected_key, h) for h in hashes}
    assert connector.codec.read_blocks([3, 5]) == [store.blocks[(expected_key, h)] for h in hashes]
