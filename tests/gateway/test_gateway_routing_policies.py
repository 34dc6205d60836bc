"""The router picks: the replica holding a prompt's prefix (kv), the least loaded (load,
and kv when loads are imbalanced), or in turn; never a replica that left or is not
ready, whatever a stale index says."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.gateway.routing.config import RouterConfig
from kvmesh.gateway.routing.policies import POLICY_CLASSES, RoutingReason
from kvmesh.gateway.routing.router import Router
from kvmesh.protos import scheduler_pb2
from kvmesh.services.contracts.block_hash import BlockHash
from kvmesh.services.contracts.errors import UnavailableError
from kvmesh.services.runtime.config import ROUTING_POLICIES, GatewayConfig, RoutingPolicyName
from tests.scheduler.factories import make_request, make_scheduler

BLOCK_SIZE = 4
SYSTEM_PROMPT = list(range(1000, 1032))  # 8 blocks


def make_router(*names: str, policy: str = RoutingPolicyName.KV, **config: object) -> Router:
    router = Router(RouterConfig(block_size=BLOCK_SIZE, policy=policy, **config))
    for name in names:
        router.add_replica(name)
    return router


def send(router: Router, name: str, **fields: object) -> None:
    """The replica's next batch on its stream (a load report when it has no events)."""
    feed = router.replica(name).feed
    sequence = feed.last_sequence + (1 if fields.get("events") else 0)
    batch = scheduler_pb2.KVEventBatch(instance_id=feed.instance_id, sequence=sequence, **fields)
    router.apply_kv_events(name, batch)


def store(router: Router, name: str, hashes: list[BlockHash]) -> None:
    stored = scheduler_pb2.BlockStored(block_hashes=hashes, block_size=BLOCK_SIZE)
    send(router, name, events=[scheduler_pb2.KVCacheEvent(stored=stored)])


def report_load(router: Router, name: str, requests: int = 0, active_blocks: int = 0) -> None:
    send(
        router,
        name,
        load=scheduler_pb2.ReplicaLoad(num_running=requests, num_active_blocks=active_blocks),
    )


def user_prompt(user: int) -> list[int]:
    return SYSTEM_PROMPT + [user] * 10


def test_every_declared_routing_policy_has_a_class() -> None:
    assert set(POLICY_CLASSES) == set(ROUTING_POLICIES)
    with pytest.raises(ValueError, match="routing_policy"):
        GatewayConfig(routing_policy="random")


def test_router_hashes_prompts_exactly_as_the_scheduler_does() -> None:
    router = make_router()
    scheduler = make_scheduler(block_size=BLOCK_SIZE)
    for salt in (None, "tenant-a"):
        request = make_request(0, prompt_token_ids=user_prompt(1), cache_salt=salt)
        scheduler.kv_cache_manager.update_block_hashes(request)
        # All full blocks but the one holding the last token (never a hit).
        hashes = router.prompt_block_hashes(user_prompt(1), salt)
        assert hashes == request.block_hashes[: (len(user_prompt(1)) - 1) // BLOCK_SIZE]


def test_kv_picks_the_replica_holding_the_prefix() -> None:
    router = make_router("a", "b", "c")
    store(router, "b", router.prompt_block_hashes(user_prompt(1)))
    decision = router.pick(user_prompt(2))
    assert decision.replica == "b"
    assert decision.reason is RoutingReason.KV_COST
    assert (decision.num_overlap_blocks, decision.num_cacheable_blocks) == (8, 10)
    # The same prompt under another salt shares nothing with the unsalted cache.
    assert router.pick(user_prompt(2), cache_salt="other").num_overlap_blocks == 0


def test_kv_weighs_prefill_saved_against_decode_load() -> None:
    router = make_router("holder", "idle")
    store(router, "holder", router.prompt_block_hashes(SYSTEM_PROMPT))
    # 7 blocks of prefill saved (and 7 blocks fewer to hold) outweigh 5 more active blocks...
    report_load(router, "holder", requests=1, active_blocks=5)
    assert router.pick(user_prompt(1)).replica == "holder"
    # ...but not 40.
    report_load(router, "holder", requests=1, active_blocks=40)
    assert router.pick(user_prompt(1)).replica == "idle"


def test_kv_counts_a_prefix_shared_with_running_requests_once() -> None:
    """Users of one hot system prompt stay on its holder: the prefix blocks its
    running request holds are not load the next user adds (Dynamo's cost). Counted
    twice, the holder would look busier than an idle replica and each user there
    would be a cache miss (the bug this test pins)."""
    router = make_router("holder", "idle")
    store(router, "holder", router.prompt_block_hashes(user_prompt(1))[:8])
    # User 1 runs on the holder: its 11 blocks, 8 of them the shared prefix.
    report_load(router, "holder", requests=1, active_blocks=11)
    decision = router.pick(user_prompt(2))
    assert (decision.replica, decision.num_overlap_blocks) == ("holder", 8)
    # The router's estimate until the next report: user 2 added its 3 own blocks.
    assert router.replica("holder").num_active_blocks == 14
    assert router.pick(user_prompt(3)).replica == "holder"
    # A replica holding no prefix costs its load plus the whole prompt, twice over.
    report_load(router, "holder", requests=3, active_blocks=30)
    assert router.pick(user_prompt(4)).replica == "idle"


def test_a_replica_with_a_queue_is_loaded_before_its_scheduler_allocates() -> None:
    router = make_router("queued", "running")
    # "queued" holds no blocks yet but queues two prompts of 10 blocks each.
    send(
        router,
        "queued",
        load=scheduler_pb2.ReplicaLoad(num_waiting=2, num_active_blocks=0, num_waiting_blocks=20),
    )
    report_load(router, "running", requests=2, active_blocks=12)
    assert router.pick(user_prompt(1)).replica == "running"


def test_kv_falls_back_to_least_loaded_when_loads_are_imbalanced() -> None:
    router = make_router("holder", "idle", balance_abs_threshold=8, balance_rel_threshold=1.5)
    store(router, "holder", router.prompt_block_hashes(SYSTEM_PROMPT))
    report_load(router, "idle", requests=2)
    report_load(router, "holder", requests=10)  # 8 more: not beyond the threshold
    assert router.pick(user_prompt(1)).replica == "holder"
    report_load(router, "holder", requests=11)
    decision = router.pick(user_prompt(1))
    assert (decision.replica, decision.reason) == ("idle", RoutingReason.IMBALANCE)


def test_load_picks_the_least_loaded_and_spreads_a_burst_between_reports() -> None:
    router = make_router("a", "b", "c", policy=RoutingPolicyName.LOAD)
    report_load(router, "a", requests=3)
    picks = [router.pick(user_prompt(u)).replica for u in range(7)]
    # b and c take turns until they carry a's 3 requests, then all three do.
    assert sorted(picks[:6]) == ["b", "b", "b", "c", "c", "c"]
    assert picks[6] in {"a", "b", "c"}
    # A report replaces the router's estimate.
    report_load(router, "b", requests=0)
    report_load(router, "c", requests=9)
    assert router.pick(user_prompt(1)).replica == "b"


def test_round_robin_takes_turns() -> None:
    router = make_router("a", "b", "c", policy=RoutingPolicyName.ROUND_ROBIN)
    store(router, "a", router.prompt_block_hashes(SYSTEM_PROMPT))
    picks = [router.pick(user_prompt(1)).replica for _ in range(6)]
    assert picks[:3] == picks[3:] and sorted(picks[:3]) == ["a", "b", "c"]


def test_a_removed_replica_is_never_picked_and_its_slot_starts_empty() -> None:
    router = make_router("a", "b")
    store(router, "a", router.prompt_block_hashes(SYSTEM_PROMPT))
    report_load(router, "b", requests=1, active_blocks=3)
    router.remove_replica("a")
    assert {router.pick(user_prompt(u)).replica for u in range(5)} == {"b"}
    router.add_replica("c")  # reuses a's slot, not a's blocks
    assert router.replica("c").slot == 0
    assert router.index.num_blocks(0) == 0
    assert router.pick(user_prompt(1)).num_overlap_blocks == 0


def test_a_replica_that_is_not_ready_is_skipped_and_rejoins_with_its_index() -> None:
    router = make_router("a", "b")
    store(router, "a", router.prompt_block_hashes(SYSTEM_PROMPT))
    router.set_routable("a", False)
    assert router.pick(user_prompt(1)).replica == "b"
    router.set_routable("a", True)
    assert router.pick(user_prompt(1)).replica == "a"
    router.set_routable("a", False)
    router.set_routable("b", False)
    with pytest.raises(UnavailableError):
        router.pick(user_prompt(1))


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(ROUTING_POLICIES),
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 8), st.integers(0, 50), st.integers(0, 200)),
        min_size=1,
        max_size=6,
    ),
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
)
def test_a_stale_index_only_changes_which_serving_replica_is_picked(
    policy: str, replicas: list[tuple[bool, int, int, int]], prompt_users: list[int]
) -> None:
    """Whatever the index claims (blocks long evicted, prefixes of replicas that
    are not ready), a pick is a routable replica, or UnavailableError if none is."""
    router = make_router(policy=policy)
    hashes = router.prompt_block_hashes(SYSTEM_PROMPT)
    for index, (routable, num_blocks, requests, active_blocks) in enumerate(replicas):
        name = f"r{index}"
        router.add_replica(name)
        store(router, name, hashes[:num_blocks])
        report_load(router, name, requests, active_blocks)
        router.set_routable(name, routable)
    serving = {f"r{i}" for i, replica in enumerate(replicas) if replica[0]}
    for user in prompt_users:
        if not serving:
            with pytest.raises(UnavailableError):
                router.pick(user_prompt(user))
            continue
        decision = router.pick(user_prompt(user))
        assert decision.replica in serving
        assert 0 <= decision.num_overlap_blocks <= decision.num_cacheable_blocks
