"""LoRA in the scheduler: no step carries more adapters than the worker's slots, and
the prefix cache never shares KV across adapters or with the base model."""

from __future__ import annotations

import pytest

from kvmesh.protos import common_pb2, scheduler_pb2
from kvmesh.scheduler.lora_admission import request_lora
from kvmesh.services.contracts.block_hash import (
    extend_block_hashes,
    first_block_extra_keys,
    sha256_block_hash,
)
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.contracts.lora_request import LoRARequest
from tests.scheduler.factories import make_request, make_scheduler, run_step

PROMPT = list(range(700, 740))  # 2 full blocks of 16 + 8


def adapter(name: str) -> LoRARequest:
    return LoRARequest(lora_name=name, lora_id=f"id-{name}", lora_path=f"/adapters/{name}")


def _distinct_adapters(sched, out) -> set[str]:
    return {
        sched.requests[rid].lora_request.lora_id
        for rid in out.num_scheduled_tokens
        if rid in sched.requests and sched.requests[rid].lora_request is not None
    }


def test_admission_keeps_distinct_adapters_within_max_loras() -> None:
    sched = make_scheduler(max_loras=2)
    requests = [
        make_request(8, max_tokens=3, lora_request=adapter(name))
        for name in ["a", "b", "c", "a", "d", "b"]
    ]
    base = make_request(8, max_tokens=3)
    for request in [*requests, base]:
        sched.add_request(request)
    out, _ = run_step(sched)
    # a and b take the two slots; c and d wait, the base model and more a/b go ahead.
    admitted = {new.req_id for new in out.scheduled_new_reqs}
    assert admitted == {requests[i].request_id for i in (0, 1, 3, 5)} | {base.request_id}
    assert [
        new.lora_request for new in out.scheduled_new_reqs if new.req_id == requests[0].request_id
    ] == [adapter("a")]
    # The skipped requests kept their place at the head of the queue, in order.
    assert [r.request_id for r in sched.waiting] == [requests[2].request_id, requests[4].request_id]
    steps = 1
    while sched.requests:
        out, _ = run_step(sched)
        assert len(_distinct_adapters(sched, out)) <= 2
        steps += 1
        sched.check_integrity()
    assert steps < 20


def test_base_model_requests_are_never_held_back_by_adapters() -> None:
    sched = make_scheduler(max_loras=1)
    first = make_request(8, max_tokens=5, lora_request=adapter("a"))
    blocked = make_request(8, max_tokens=5, lora_request=adapter("b"))
    base = make_request(8, max_tokens=5)
    for request in (first, blocked, base):
        sched.add_request(request)
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {first.request_id, base.request_id}


def test_adapter_prefixes_never_share_blocks() -> None:
    sched = make_scheduler(max_loras=4)
    owners = [
        make_request(40, max_tokens=30, prompt_token_ids=PROMPT, lora_request=lora)
        for lora in (None, adapter("a"))
    ]
    for owner in owners:
        sched.add_request(owner)
    while any(o.num_computed_tokens < o.num_prompt_tokens for o in owners):
        run_step(sched)
    followers = {
        name: make_request(40, prompt_token_ids=PROMPT, lora_request=lora)
        for name, lora in (("base", None), ("a", adapter("a")), ("b", adapter("b")))
    }
    for follower in followers.values():
        sched.add_request(follower)
    out, _ = run_step(sched)
    cached = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    # The same adapter (or the base model) hits its own 2 blocks; adapter b hits nothing.
    assert cached == {
        followers["base"].request_id: 32,
        followers["a"].request_id: 32,
        followers["b"].request_id: 0,
    }
    base_blocks = sched.get_block_ids(followers["base"].request_id)[:2]
    a_blocks = sched.get_block_ids(followers["a"].request_id)[:2]
    assert not set(base_blocks) & set(a_blocks)
    sched.check_integrity()


def test_adapter_keys_cannot_be_forged_by_a_salt() -> None:
    def hashes(salt: str | None, lora_id: str | None) -> list[bytes]:
        out: list[bytes] = []
        extend_block_hashes(out, PROMPT, 16, salt, sha256_block_hash, lora_id)
        return out

    # A salt alone hashes as before adapters existed (stored KV stays valid).
    assert first_block_extra_keys("s", None) == ("s",)
    variants = [
        hashes(None, None),
        hashes("id-a", None),
        hashes("lora", None),
        hashes(None, "id-a"),
        hashes("s", "id-a"),
        hashes(None, "id-b"),
    ]
    assert len({tuple(v) for v in variants}) == len(variants)
    # Chained: every block differs, not only the first.
    assert not set(variants[0]) & set(variants[3])


def _add_msg(lora: common_pb2.LoRARequest | None) -> scheduler_pb2.AddRequestRequest:
    msg = scheduler_pb2.AddRequestRequest(request_id="r", prompt_token_ids=[1, 2])
    if lora is not None:
        msg.lora_request.CopyFrom(lora)
    return msg


def test_add_request_checks_the_adapter_against_the_worker() -> None:
    full = common_pb2.LoRARequest(lora_name="a", lora_id="id-a", lora_path="/adapters/a")
    assert request_lora(_add_msg(None), max_loras=0) is None
    assert request_lora(_add_msg(full), max_loras=2) == adapter("a")
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        request_lora(_add_msg(full), max_loras=0)
    with pytest.raises(InvalidRequestError, match="lora_id and lora_path"):
        request_lora(_add_msg(common_pb2.LoRARequest(lora_name="a", lora_id="id-a")), 2)
