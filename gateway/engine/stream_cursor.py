"""What one request's reader already received, so a replayed stream repeats nothing.

After a detokenizer restart (or a continuation after a scheduler restart) the
detokenizer rebuilds a request's state from its first output token and sends
everything again, marked ``replay`` (protos/detokenizer.proto). The text a
detokenizer emits is a function of the tokens alone, so its concatenated
deltas from a replay on are the same string as the original ones: counting
characters (and tokens) from the replay's start and forwarding only what lies
past the delivered count continues the stream without a duplicate or missing
character, wherever the old detokenizer stopped, even in the middle of held-back
text (an incomplete character, a possible stop-string prefix).

Until a replay arrives, outputs of a new detokenizer are not comparable with
what was delivered: their text continues the new detokenizer's state, whose
start the reader may never have seen (a replay sent before the gateway
subscribed again is lost to it). A cursor told to ``await_replay`` drops
them; the replay the gateway asks for (ResyncRequests) covers their tokens,
and a request the scheduler finished meanwhile is resubmitted instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass
class CursorDelta:
    """The part of one detokenizer output its reader has not seen."""

    text: str
    token_ids: list[int]
    # Per new token, when logprobs came with them; a replayed token that the
    # reader never saw has none (logprobs are not replayed).
    logprobs: list | None
    # Whether this output was the first of the request the reader sees.
    first: bool


@dataclass
class StreamCursor:
    """Delivered text and tokens of one request, and the replay epoch's counts."""

    # Every token id forwarded to the reader, in order (a continuation resumes from them).
    token_ids: list[int] = field(default_factory=list)
    num_chars: int = 0
    # Counted from the start of the current detokenizer state (reset by a replay).
    _epoch_chars: int = 0
    _epoch_tokens: int = 0
    _seen_any: bool = False
    # Set when the detokenizer stream was lost and reopened: drop until a replay.
    _awaiting_replay: bool = False

    def await_replay(self) -> None:
        self._awaiting_replay = True

    def advance(
        self, text: str, token_ids: list[int], logprobs: list[T] | None, replay: bool
    ) -> CursorDelta:
        """Account one output; returns what is new to the reader."""
        if replay:
            self._epoch_chars = self._epoch_tokens = 0
            self._awaiting_replay = False
        elif self._awaiting_replay:
            return CursorDelta("", [], None, first=False)
        start = self._epoch_chars
        self._epoch_chars += len(text)
        new_text = text[max(0, self.num_chars - start) :]
        self.num_chars = max(self.num_chars, self._epoch_chars)

        start = self._epoch_tokens
        self._epoch_tokens += len(token_ids)
        skip = max(0, len(self.token_ids) - start)
        new_tokens = token_ids[skip:]
        self.token_ids.extend(new_tokens)
        if logprobs:
            # Logprobs cover the last len(logprobs) ids of this output.
            logprobs = logprobs[max(0, skip - (len(token_ids) - len(logprobs))) :]
        first, self._seen_any = not self._seen_any, True
        return CursorDelta(new_text, new_tokens, logprobs or None, first)
