"""A deterministic in-process engine for driving the gateway without a network or model.

Output token ``i`` of a request is ``prompt[(i + offset) % len(prompt)]`` where
``offset`` is the request's choice suffix (``...-3`` -> 3), so siblings of an
``n > 1`` request differ and every output is predictable from the prompt.
Text comes from the real tokenizer's decode; stop strings, stop token ids,
EOS and max_tokens end a request the way the real detokenizer and scheduler
do (stop strings truncated unless ``include_stop_str_in_output``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvmesh.gateway.engine.client import (
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    TokenLogprob,
    TopLogprob,
)
from kvmesh.services.contracts.errors import UnavailableError


@dataclass
class FakeEngineClient:
    decode: Callable[[list[int]], str]
    info: ModelInfo
    # Raised from generate() before any delta (a refused admission, or a bug).
    fail_with: Exception | None = None
    # After this many deltas, end the request with finish_reason="error".
    fail_after_deltas: int | None = None
    # After this many deltas, stop producing anything until aborted.
    hang_after_deltas: int | None = None
    # Prompt tokens reported as prefix-cache hits.
    num_cached_tokens: int = 0
    # Hits reported by the samples after the first of an n > 1 request (the
    # scheduler computes the prompt once and lets the siblings hit its cache).
    num_sibling_cached_tokens: int | None = None
    # When set, every request generates these token ids instead of echoing its prompt.
    script: list[int] | None = None
    ready: bool = True
    requests: list[GenerationRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    hanging: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def model_info(self) -> ModelInfo:
        return self.info

    async def check_ready(self) -> None:
        if not self.ready:
            raise UnavailableError("worker unreachable")

    async def abort(self, request_id: str) -> None:
        # A real abort is a network call; yielding here means an abort issued
        # from a cancelled task is only recorded if the caller shielded it.
        await asyncio.sleep(0)
        self.aborted.append(request_id)

    def expected_token_ids(self, request: GenerationRequest, count: int) -> list[int]:
        if self.script is not None:
            return self.script[:count]
        prompt = request.prompt_token_ids
        offset = _choice_offset(request.request_id)
        return [prompt[(i + offset) % len(prompt)] for i in range(count)]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        if self.fail_with is not None:
            raise self.fail_with
        self.requests.append(request)
        params, detok = request.sampling_params, request.detokenize_params
        candidates = self.expected_token_ids(request, params.max_tokens)
        output: list[int] = []
        sent_text = ""
        for step, token_id in enumerate(candidates):
            if self.hang_after_deltas is not None and step >= self.hang_after_deltas:
                self.hanging.set()
                await asyncio.Event().wait()  # until cancelled by abort/close
            if self.fail_after_deltas is not None and step >= self.fail_after_deltas:
                yield self._delta(request, "", [], output, "error", None, error="worker died")
                return
            await asyncio.sleep(0)  # let other requests interleave like engine steps
            output.append(token_id)
            finish_reason: str | None = None
            stop_reason: int | str | None = None
            if len(output) >= params.min_tokens and (
                token_id in params.stop_token_ids
                or (not params.ignore_eos and token_id in self.info.eos_token_ids)
            ):
                finish_reason, stop_reason = "stop", token_id
            full_text = self.decode(output)
            for stop in detok.stop:
                position = full_text.find(stop)
                if position >= 0:
                    end = position + len(stop) if detok.include_stop_str_in_output else position
                    full_text = full_text[:end]
                    finish_reason, stop_reason = "stop", stop
                    break
            if finish_reason is None and len(output) >= params.max_tokens:
                finish_reason = "length"
            new_text = full_text[len(sent_text) :]
            sent_text = full_text
            delta = self._delta(
                request, new_text, [token_id], output, finish_reason, stop_reason, logprob_step=step
            )
            if step == 0:
                delta.prompt_logprobs = self._prompt_logprobs(request)
            yield delta
            if finish_reason is not None:
                return

    def _delta(
        self,
        request: GenerationRequest,
        text: str,
        token_ids: list[int],
        output: list[int],
        finish_reason: str | None,
        stop_reason: int | str | None,
        error: str | None = None,
        logprob_step: int = 0,
    ) -> GenerationDelta:
        num_top = request.sampling_params.logprobs
        logprobs = None
        if num_top is not None:
            logprobs = [
                fake_logprob(token_id, logprob_step, num_top, self.decode) for token_id in token_ids
            ]
        return GenerationDelta(
            request_id=request.request_id,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=self._cached_tokens(request),
            num_output_tokens=len(output),
            logprobs=logprobs,
            error=error,
        )

    def _prompt_logprobs(self, request: GenerationRequest) -> list[TokenLogprob | None] | None:
        """Prompt token p scored like an output token of step p (see fake_logprob)."""
        num_top = request.sampling_params.prompt_logprobs
        if num_top is None:
            return None
        prompt = request.prompt_token_ids
        scored = [fake_logprob(prompt[p], p, num_top, self.decode) for p in range(1, len(prompt))]
        return [None, *scored]

    def _cached_tokens(self, request: GenerationRequest) -> int:
        is_sibling = request.parallel_group is not None and _choice_offset(request.request_id) > 0
        if is_sibling and self.num_sibling_cached_tokens is not None:
            return self.num_sibling_cached_tokens
        return self.num_cached_tokens


def fake_logprob(
    token_id: int, step: int, num_top: int, decode: Callable[[list[int]], str]
) -> TokenLogprob:
    """Sampled token at -0.5*(step+1); alternatives token_id+1.. at decreasing logprobs."""
    sampled = -0.5 * (step + 1)
    top = [
        TopLogprob(token_id=token_id + k, token=decode([token_id + k]), logprob=sampled - k)
        for k in range(num_top)
    ]
    return TokenLogprob(
        token_id=token_id, token=decode([token_id]), logprob=sampled, top_logprobs=top, rank=1
    )


def _choice_offset(request_id: str) -> int:
    suffix = request_id.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else 0
