"""The table of live requests' detokenizers, processed one engine step at a time."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from tokenizers import Tokenizer

from kvmesh.detokenizer.incremental import DetokenizedDelta, IncrementalDetokenizer
from kvmesh.services.contracts.sampling_params import DetokenizeParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_REQUESTS = 4096


class DetokenizerTableFullError(RuntimeError):
    """More live requests than the table was sized for."""


class StepInput(NamedTuple):
    """One request's share of a step (a plain 3-tuple works too)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    # The last new id is the EOS / stop token that ended the request.
    stopped_by_token: bool = False


@dataclass(frozen=True)
class StepResult:
    """One request's outcome of a step: a delta, or an error for that request only."""

    request_id: str
    delta: DetokenizedDelta | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class DetokenizerTable:
    """Incremental detokenizers keyed by request id.

    An entry lives from ``add`` until the scheduler reports the request
    finished (its last ``process``) or ``remove`` (abort). A request ended by a
    stop string stays until then, answering empty deltas, because tokens
    already in flight may still arrive before the scheduler learns of the stop.
    """

    def __init__(
        self, tokenizer: Tokenizer, max_num_requests: int = DEFAULT_MAX_NUM_REQUESTS
    ) -> None:
        if max_num_requests <= 0:
            raise ValueError(f"max_num_requests must be positive, got {max_num_requests}")
        self._tokenizer = tokenizer
        self._max_num_requests = max_num_requests
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def __len__(self) -> int:
        return len(self._detokenizers)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._detokenizers

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: DetokenizeParams,
        *,
        with_token_texts: bool = False,
    ) -> None:
        """Start tracking a request. Raises on a duplicate id or a full table."""
        if request_id in self._detokenizers:
            raise KeyError(f"request {request_id!r} is already being detokenized")
        if len(self._detokenizers) >= self._max_num_requests:
            raise DetokenizerTableFullError(
                f"detokenizer table is full ({self._max_num_requests} live requests)"
            )
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self._tokenizer, prompt_token_ids, params, with_token_texts=with_token_texts
        )
        logger.debug("request %s: detokenizer added", request_id)

    def process(
        self,
        request_id: str,
        new_token_ids: list[int],
        finished: bool,
        *,
        stopped_by_token: bool = False,
    ) -> DetokenizedDelta:
        """Advance one request. Raises ``KeyError`` for an unknown id,
        ``InvalidTokenIdError`` for an id outside the vocabulary."""
        detokenizer = self._detokenizers.get(request_id)
        if detokenizer is None:
            raise KeyError(f"unknown request {request_id!r}")
        try:
            delta = detokenizer.update(new_token_ids, finished, stopped_by_token=stopped_by_token)
        except Exception:
            # A request whose tokens cannot be decoded is over; keeping it
            # would leak its entry since the scheduler will fail it.
            self.remove(request_id)
            raise
        if finished:
            self.remove(request_id)
        if delta.stop_string is not None:
            logger.debug("request %s: stop string %r matched", request_id, delta.stop_string)
        return delta

    def process_step(self, step: Iterable[StepInput | tuple]) -> list[StepResult]:
        """Advance every request of one engine step; never raises for the batch.

        A failure (unknown id, invalid token id, decoder error) becomes that
        request's ``StepResult.error``; the other requests are unaffected.
        Results come in input order.
        """
        results: list[StepResult] = []
        for item in step:
            request_id = str(item[0]) if len(item) > 0 else ""
            try:
                step_input = StepInput(*item)
                delta = self.process(
                    step_input.request_id,
                    [int(token_id) for token_id in step_input.new_token_ids],
                    step_input.finished,
                    stopped_by_token=step_input.stopped_by_token,
                )
            except Exception as exc:
                logger.warning("request %s: detokenization failed: %s", request_id, exc)
                results.append(StepResult(request_id, None, _describe(exc)))
            else:
                results.append(StepResult(request_id, delta))
        return results

    def remove(self, request_id: str) -> bool:
        """Forget a request (finished or aborted). Returns whether it was known."""
        removed = self._detokenizers.pop(request_id, None) is not None
        if removed:
            logger.debug("request %s: detokenizer removed", request_id)
        return removed


def _describe(exc: Exception) -> str:
    # KeyError's str() is the repr of its argument; show the message itself.
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return f"{type(exc).__name__}: {message}"
