"""A parallel replica's KV: keys per TP rank and stage; a transfer is done when done everywhere."""

from __future__ import annotations

import torch

from kvmesh.services.contracts.step import KVConnectorOutput
from kvmesh.worker.kv_layout import worker_kv_layout
from kvmesh.worker.parallel.replica_kv_connector import TransferTally


def _layout(tp_rank: int = 0, tp_size: int = 1, layers: range | None = None):
    return worker_kv_layout("smol", torch.float32, 16, 30, 3, 64, tp_rank, tp_size, layers)


def test_tp_ranks_of_two_replicas_share_keys_but_never_with_tp1() -> None:
    replica_a = [_layout(rank, 2) for rank in range(2)]
    replica_b = [_layout(rank, 2) for rank in range(2)]
    assert [a.namespace for a in replica_a] == [b.namespace for b in replica_b]
    assert replica_a[0].namespace != replica_a[1].namespace
    assert _layout().namespace not in {a.namespace for a in replica_a}


def test_pipeline_stages_key_their_own_layers() -> None:
    stages = [_layout(layers=range(0, 15)), _layout(layers=range(15, 30))]
    assert stages[0].namespace != stages[1].namespace
    assert _layout().namespace not in {s.namespace for s in stages}
    # The whole range is the unsplit model's layout.
    assert _layout(layers=range(0, 30)).namespace == _layout().namespace


def test_a_load_finishes_when_every_rank_loaded_with_the_fewest_blocks() -> None:
    tally = TransferTally(world_size=2)
    first = tally.add([KVConnectorOutput(finished_loads={"a": 4}), KVConnectorOutput()])
    assert first.finished_loads == {}
    second = tally.add([KVConnectorOutput(), KVConnectorOutput(finished_loads={"a": 3})])
    assert second.finished_loads == {"a": 3}
    assert tally.loads == {}


def test_a_save_is_saved_only_if_every_rank_saved_its_shard() -> None:
    tally = TransferTally(world_size=2)
    done = tally.add(
        [
            KVConnectorOutput(saved_block_hashes=[b"x", b"y"]),
            KVConnectorOutput(saved_block_hashes=[b"x"], failed_save_hashes=[b"y"]),
        ]
    )
    assert done.saved_block_hashes == [b"x"]
    assert done.failed_save_hashes == [b"y"]
    pending = tally.add([KVConnectorOutput(saved_block_hashes=[b"z"]), KVConnectorOutput()])
    assert pending.is_empty() and list(tally.saves) == [b"z"]


def test_a_block_saved_twice_settles_twice() -> None:
    tally = TransferTally(world_size=2)
    early = tally.add(
        [KVConnectorOutput(saved_block_hashes=[b"x"]), KVConnectorOutput(saved_block_hashes=[b"x"])]
    )
    assert early.saved_block_hashes == [b"x"]
    # Rank 0 reports the second save of b"x" a step before rank 1.
    assert tally.add([KVConnectorOutput(saved_block_hashes=[b"x"]), KVConnectorOutput()]).is_empty()
    late = tally.add([KVConnectorOutput(), KVConnectorOutput(saved_block_hashes=[b"x"])])
    assert late.saved_block_hashes == [b"x"] and tally.saves == {}


def test_a_dropped_request_forgets_its_partial_load() -> None:
    tally = TransferTally(world_size=2)
    tally.add([KVConnectorOutput(finished_loads={"a": 2}), KVConnectorOutput()])
    tally.forget_loads({"a"})
    # A new load of "a" needs every rank again.
    assert tally.add([KVConnectorOutput(), KVConnectorOutput(finished_loads={"a": 2})]).is_empty()
