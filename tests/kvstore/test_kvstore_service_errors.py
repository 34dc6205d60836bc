"""The kvstore service refuses a caller's bad lease as INVALID_REQUEST, not as a bug."""

from __future__ import annotations

import pytest

from kvstore.server import KVStoreServicer
from kvstore.store import BlockStore
from protos import kvstore_pb2
from services.errors import ErrorKind, InvalidRequestError


@pytest.mark.parametrize("ttl_seconds", [0.0, -1.0])
async def test_non_positive_lease_ttl_is_an_invalid_request(ttl_seconds: float) -> None:
    servicer = KVStoreServicer(BlockStore(1_000))
    request = kvstore_pb2.LeaseBlocksRequest(keys=[b"k"], ttl_seconds=ttl_seconds)
    with pytest.raises(InvalidRequestError) as refused:
        await servicer.LeaseBlocks(request, context=None)
    assert refused.value.kind is ErrorKind.INVALID_REQUEST
    assert refused.value.param == "ttl_seconds"
