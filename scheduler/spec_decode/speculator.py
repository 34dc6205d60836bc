"""Which requests get drafts this step, how many, and what came of them.

The scheduler proposes drafts because it holds every request's prompt and
output already: n-gram and suffix proposals need no extra round trip, and the
worker stays a pure function of the step it is sent.

Back-off, so that speculation never costs more than it saves:
- per step: no drafts when the running batch is larger than
  ``disable_by_batch_size`` (a big batch already uses the compute that
  verification would need);
- per request: an exponential moving average of its acceptance rate; when it
  falls below ``min_acceptance_rate`` the request stops drafting for a pause
  that doubles each time (8, 16, ... 256 steps) and halves when drafting pays
  again, so a request whose text stops repeating costs only a few wasted
  verification slots every few hundred steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.scheduler.request import Request
from kvmesh.scheduler.spec_decode.ngram import NgramProposer
from kvmesh.scheduler.spec_decode.suffix import SuffixProposer
from kvmesh.services.runtime.config import SpeculativeConfig

# Weight of the newest step in a request's acceptance-rate average.
EMA_WEIGHT = 0.5
MIN_PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 256


@dataclass
class SpecDecodingStats:
    """Counters since the previous snapshot (vLLM's spec_decode metrics)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Entry i: drafts accepted at position i (0-based).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step: accepted drafts plus the one sampled after them."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _Backoff:
    acceptance_ema: float = 1.0
    resume_step: int = 0
    pause_steps: int = MIN_PAUSE_STEPS // 2


class Speculator:
    """Proposes drafts per request and tracks acceptance; owned by the Scheduler."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.ngram = (
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == "ngram"
            else None
        )
        self.suffix = (
            SuffixProposer(
                config.suffix_decoding_max_tree_depth,
                config.suffix_decoding_max_spec_factor,
                config.suffix_decoding_max_cached_requests,
            )
            if config.method == "suffix"
            else None
        )
        self._backoff: dict[str, _Backoff] = {}
        self._stats = self._empty_stats()

    def _empty_stats(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * self.config.num_speculative_tokens
        )

    def batch_too_large(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return 0 < limit < num_running

    def propose(self, request: Request, token_budget: int, step: int) -> list[int]:
        """Drafts for a request about to decode one token; [] when it should not speculate.

        Never more than fit the token budget (with the token itself), nor more
        than could be kept before max_tokens or max_model_len end the request.
        """
        params = request.sampling_params
        # Structured output: the grammar would have to be advanced through
        # every draft and rolled back; seeded sampling: its promise (same
        # seed, same text) would depend on which drafts the batch produced.
        if params.structured_output is not None or (
            params.seed is not None and not params.is_greedy
        ):
            return []
        backoff = self._backoff.get(request.request_id)
        if backoff is not None and step < backoff.resume_step:
            return []
        max_drafts = min(
            self.config.num_speculative_tokens,
            token_budget - 1,
            params.max_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - len(request.all_token_ids) - 1,
        )
        if max_drafts <= 0:
            return []
        if self.ngram is not None:
            return self.ngram.propose(request.all_token_ids, max_drafts)
        assert self.suffix is not None
        return self.suffix.propose(request.request_id, request.all_token_ids, max_drafts)

    def record(self, request_id: str, num_drafts: int, num_accepted: int, step: int) -> None:
        """One verification's outcome: counters, and the request's back-off."""
        stats = self._stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.num_accepted_tokens_per_pos
        for position in range(num_accepted):
            per_pos[position] += 1
        backoff = self._backoff.get(request_id)
        if backoff is None:
            backoff = self._backoff[request_id] = _Backoff()
        rate = num_accepted / num_drafts
        backoff.acceptance_ema += EMA_WEIGHT * (rate - backoff.acceptance_ema)
        if rate >= self.config.min_acceptance_rate:  # this one paid: shorter pauses
            backoff.pause_steps = max(MIN_PAUSE_STEPS // 2, backoff.pause_steps // 2)
        if backoff.acceptance_ema >= self.config.min_acceptance_rate:
            return
        backoff.pause_steps = min(MAX_PAUSE_STEPS, backoff.pause_steps * 2)
        backoff.resume_step = step + backoff.pause_steps
        # After the pause the request gets a fresh chance, not its old average.
        backoff.acceptance_ema = 1.0

    def finish(self, request: Request) -> None:
        """The request left for good (finished or aborted): forget it, learn its output."""
        self._backoff.pop(request.request_id, None)
        if self.suffix is not None:
            self.suffix.finish(request.request_id, request.output_token_ids)

    def make_stats(self) -> SpecDecodingStats:
        stats, self._stats = self._stats, self._empty_stats()
        return stats
