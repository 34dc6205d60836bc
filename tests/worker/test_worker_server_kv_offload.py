"""The worker service with KV offload: its layout in WorkerInfo, connector work over the wire."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.kvstore.layout import KVLayout
from kvmesh.protos import worker_pb2
from kvmesh.services.runtime.config import WorkerConfig
from kvmesh.worker.server import WorkerServicer, attach_kv_connector, build_runner, runner_kv_layout
from tests.worker.kv_connector_helpers import (
    InMemoryKVBlockStore,
    block_hashes,
    drain,
    loop_thread,
)

from .conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_checkpoint(folder, "LlamaForCausalLM", torch.float32)
    return folder


def test_step_requests_carry_saves_and_results_report_them(checkpoint: Path) -> None:
    config = WorkerConfig(
        model=str(checkpoint),
        block_size=4,
        num_kv_blocks=16,
        num_threads=1,
        kv_offload=True,
        dtype="float32",
    )
    runner, info = build_runner(config)
    assert not info.HasField("kv_layout")  # no connector yet
    store = InMemoryKVBlockStore()
    hashes = block_hashes("wire", 2)
    with loop_thread() as loop:
        layout = runner_kv_layout(runner, info)
        connector = attach_kv_connector(runner, info, store, layout, loop)
        model = runner.model_config
        assert layout.model == (
            f"{checkpoint.name};layers={model.num_layers};kv_heads={model.num_kv_heads};"
            f"head_dim={model.head_dim}"
        )
        assert (layout.dtype, layout.block_size) == ("float32", 4)
        assert KVLayout.from_proto(info.kv_layout) == layout
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
    assert set(store.blocks) == set(hashes)
    assert connector.codec.read_blocks([3, 5]) == [store.blocks[h] for h in hashes]
