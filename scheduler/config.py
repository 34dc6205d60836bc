"""Scheduler configuration: budgets, queue policy and KV cache geometry."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.services.contracts.kv_cache_groups import max_blocks_per_request
from kvmesh.services.runtime.config import (
    DEFAULT_MAX_MODEL_LEN,
    SCHEDULING_POLICIES,
    SchedulerServiceConfig,
    SpeculativeConfig,
    check_choice,
)

PREFIX_HASHES = ("sha256", "builtin")
# The step token budget when neither --max-num-batched-tokens nor the worker
# names one (WorkerInfo.step_token_budget): vLLM's default.
DEFAULT_STEP_TOKEN_BUDGET = 2048


def step_token_budget(configured: int, worker_preferred: int) -> int:
    """The budget a scheduler steps with: ``configured`` (--max-num-batched-tokens)
    when set (> 0), else what the worker's hardware runs best at, else the default."""
    if configured > 0:
        return configured
    return worker_preferred if worker_preferred > 0 else DEFAULT_STEP_TOKEN_BUDGET


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How much work one step may carry and how the KV block pool is laid out.

    Budgets, policy and prefix caching default to the scheduler service's
    flags (kvmesh.services.runtime.config), the model length to the worker's cap.
    """

    # Tokens computed in one step, over all requests (prefill chunks + decodes).
    max_num_batched_tokens: int = DEFAULT_STEP_TOKEN_BUDGET
    # Requests running at once (the worker's batch size).
    max_num_seqs: int = SchedulerServiceConfig.max_num_seqs
    # Prompt + output tokens of one request.
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # Largest prefill chunk one request may take in a step, so one long prompt
    # cannot starve the others; 0 turns the limit off.
    long_prefill_token_threshold: int = SchedulerServiceConfig.long_prefill_token_threshold
    policy: str = SchedulerServiceConfig.scheduling_policy
    # Fraction of blocks kept free when admitting a waiting request, so that
    # running requests can grow a little before someone must be preempted.
    watermark: float = 0.01
    block_size: int = 16
    num_kv_blocks: int
    enable_prefix_caching: bool = SchedulerServiceConfig.prefix_caching
    # "sha256" is collision-resistant and stable across processes; "builtin" is
    # faster but 64-bit and process-local (never share its hashes).
    prefix_hash: str = "sha256"
    # Schedule step n+1 before step n's output is back (one step in flight
    # ahead): num_computed_tokens advances at schedule time and a running
    # request's next decode slot is scheduled against a placeholder token that
    # the worker fills in itself. Outputs are identical; see Scheduler.
    async_scheduling: bool = False
    # Steps in flight at once, each a micro-batch of requests disjoint from the
    # other in-flight steps' (a request is in at most one). Pipeline parallelism
    # sets it to the number of stages, so that stage s runs one micro-batch
    # while stage s+1 runs the previous one; 1 (the default) is plain async
    # scheduling, where consecutive steps share their requests. Needs async
    # scheduling when above 1. See Scheduler.
    num_micro_batches: int = 1
    # The kvstore as a second KV tier (scheduler/kv_connector.py): full blocks
    # are saved there and a prefix-cache miss is loaded from there. Needs
    # prefix caching with the process-independent sha256 hashes (the store
    # keys blocks by them).
    enable_kv_connector: bool = False
    # Speculative decoding (scheduler/spec_decode): drafts proposed here and
    # verified by the worker. Needs synchronous scheduling: a draft is proposed
    # from the request's latest tokens, which async mode has not seen yet.
    speculative: SpeculativeConfig | None = None
    # Distinct LoRA adapters the worker can hold in one step (WorkerInfo.max_loras);
    # 0: the worker serves no adapters.
    max_loras: int = 0
    # The worker runs a pooling model (WorkerInfo.runner "pooling"): only
    # pooling requests are accepted, and generation requests only otherwise.
    pooling: bool = False
    # Per KV-cache group (services/contracts/kv_cache_groups.py, from
    # WorkerInfo), its sliding window in tokens (None: full attention). A
    # windowed group holds only the blocks inside its window; the default is
    # one full-attention group (every layer attends to every token).
    kv_cache_windows: tuple[int | None, ...] = (None,)

    def __post_init__(self) -> None:
        positive = {
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
        }
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 = off), "
                f"got {self.long_prefill_token_threshold}"
            )
        check_choice("policy", self.policy, SCHEDULING_POLICIES)
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.prefix_hash not in PREFIX_HASHES:
            raise ValueError(
                f"prefix_hash must be one of {PREFIX_HASHES}, got {self.prefix_hash!r}"
            )
        if self.enable_kv_connector and not (
            self.enable_prefix_caching and self.prefix_hash == "sha256"
        ):
            raise ValueError("the KV connector needs prefix caching with sha256 block hashes")
        if self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {self.num_micro_batches}")
        if self.num_micro_batches > 1 and not self.async_scheduling:
            raise ValueError("micro-batches (num_micro_batches > 1) need async scheduling")
        if self.speculative is not None and self.async_scheduling:
            raise ValueError("speculative decoding needs synchronous scheduling")
        # A list from a caller compares unequal to the one-group default: keep a tuple.
        object.__setattr__(self, "kv_cache_windows", tuple(self.kv_cache_windows))
        if not self.kv_cache_windows or any(
            w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0)
            for w in self.kv_cache_windows
        ):
            raise ValueError(
                "kv_cache_windows needs one positive window (or None) per KV-cache group, "
                f"got {self.kv_cache_windows!r}"
            )
        if self.enable_kv_connector and self.kv_cache_windows != (None,):
            # The connector moves one table of blocks per request (kvstore
            # offload, prefill/decode transfer); a windowed or multi-group cache
            # would be saved and loaded wrong, so it is refused, not guessed.
            raise ValueError(
                "the KV connector (kvstore offload, prefill/decode transfer) does not move "
                f"sliding-window or multi-group KV caches yet (KV-cache group windows "
                f"{self.kv_cache_windows}); turn it off for this model"
            )
        if self.kv_cache_windows == (None,):
            if self.num_kv_blocks * self.block_size < self.max_model_len:
                # A request that grew to max_model_len could never fit even alone and
                # would preempt itself forever.
                raise ValueError(
                    f"KV cache holds {self.num_kv_blocks * self.block_size} tokens "
                    f"({self.num_kv_blocks} blocks x {self.block_size}), less than "
                    f"max_model_len={self.max_model_len}; lower max_model_len or add blocks"
                )
            return
        # With groups a request holds blocks in every group, a windowed one
        # only around its window; block 0 is the null block.
        needed = max_blocks_per_request(
            self.kv_cache_windows, self.max_model_len, self.block_size, self.max_num_batched_tokens
        ) + int(any(w is not None for w in self.kv_cache_windows))
        if self.num_kv_blocks < needed:
            raise ValueError(
                f"KV cache has {self.num_kv_blocks} blocks, fewer than the {needed} one "
                f"request of max_model_len={self.max_model_len} may hold in the KV-cache groups "
                f"{self.kv_cache_windows} (block_size={self.block_size}); lower max_model_len "
                "or add blocks"
            )

    @property
    def steps_in_flight(self) -> int:
        """Steps the service keeps sent and unanswered: one (synchronous), two
        (async: one ahead), or one per micro-batch."""
        if not self.async_scheduling:
            return 1
        return max(2, self.num_micro_batches)

    @property
    def num_watermark_blocks(self) -> int:
        return int(self.watermark * self.num_kv_blocks)
