"""The kvstore service refuses a caller's bad lease as INVALID_REQUEST, not as a bug."""

from __future__ import annotations

import pytest

from kvmesh.kvstore.layout import KVLayout
from kvmesh.kvstore.server import KVStoreServicer
from kvmesh.kvstore.tiered import TieredStore
from kvmesh.protos import kvstore_pb2
from kvmesh.services.contracts.errors import ErrorKind, InvalidRequestError

LAYOUT = KVLayout(model="m", dtype="float32", block_size=16, layout_version=1)


@pytest.mark.parametrize("ttl_seconds", [0.0, -1.0, 301.0])
async def test_lease_ttl_outside_the_allowed_range_is_an_invalid_request(
    ttl_seconds: float,
) -> None:
    servicer = KVStoreServicer(TieredStore(1_000), max_lease_ttl_s=300.0)
    request = kvstore_pb2.LeaseBlocksRequest(
        layout=LAYOUT.to_proto(), block_hashes=[b"k" * 32], ttl_seconds=ttl_seconds
    )
    with pytest.raises(InvalidRequestError) as refused:
        await servicer.LeaseBlocks(request, context=None)
    assert refused.value.kind is ErrorKind.INVALID_REQUEST
    assert refused.value.param == "ttl_seconds"
