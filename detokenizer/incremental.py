"""Incremental detokenization of one request's output tokens.

Each step brings a few new token ids; ``IncrementalDetokenizer.update`` turns
them into the text to stream now. Decoding goes through the tokenizers
library's ``DecodeStream``, which keeps only a short window of ids, so the cost
of a step does not grow with the length of the output. A UTF-8 character split
over several byte-level tokens appears only once its last byte arrived.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvmesh.detokenizer.stop_strings import StopStringMatcher
from kvmesh.services.contracts.sampling_params import DetokenizeParams

logger = logging.getLogger(__name__)

# Prompt tokens given to the stream as left context. Tokenizers whose decoder
# strips a leading space (SentencePiece "▁") need it so the first output word
# keeps its space; a few tokens are enough, the rest of the prompt is not read.
PROMPT_CONTEXT_TOKENS = 6
# Emitted tokens kept as left context for the final flush of undecoded tokens.
FLUSH_CONTEXT_TOKENS = 4
_REPLACEMENT_CHAR = "\ufffd"


class InvalidTokenIdError(ValueError):
    """A token id outside the tokenizer's vocabulary."""


@dataclass(frozen=True)
class DetokenizedDelta:
    """What one step of one request adds to its text stream."""

    # New text to stream this step (may be empty).
    text: str
    # One decoded piece per new token id (for logprobs display), when asked for.
    token_texts: list[str] | None
    # The stop string that ended the request this step, if any.
    stop_string: str | None
    # True once the text stream is complete (finished by the scheduler or by a
    # stop string); later updates add nothing.
    finished: bool


class IncrementalDetokenizer:
    """Streams one request's output text: UTF-8 safe, stop strings, hold-back."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        params: DetokenizeParams,
        *,
        with_token_texts: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._with_token_texts = with_token_texts
        self._matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        context_ids = self._clean_prompt_context(prompt_token_ids)
        self._stream = DecodeStream(
            ids=context_ids or None, skip_special_tokens=params.skip_special_tokens
        )
        # Ids fed to the stream that have not produced text yet (an unfinished
        # UTF-8 character), and a few ids before them: enough to decode them
        # on their own when the request ends mid-character.
        self._undecoded_ids: list[int] = []
        self._decoded_tail_ids: list[int] = context_ids[-FLUSH_CONTEXT_TOKENS:]
        # Decoded text not streamed yet: the hold-back of a possible stop string.
        self._unsent_text = ""
        self._finished = False
        self.num_output_tokens = 0

    @property
    def finished(self) -> bool:
        return self._finished

    def update(
        self,
        new_token_ids: list[int],
        finished: bool,
        *,
        stopped_by_token: bool = False,
    ) -> DetokenizedDelta:
        """Decode this step's new tokens and return the text to stream.

        ``finished`` says the scheduler ended the request with this step: all
        held text is flushed. ``stopped_by_token`` says the last new id is the
        EOS / stop token that ended it; like vLLM, that token's text is left
        out unless ``include_stop_str_in_output``.

        Raises ``InvalidTokenIdError`` (leaving the state untouched) for an id
        outside the vocabulary.
        """
        if self._finished:
            return DetokenizedDelta("", [] if self._with_token_texts else None, None, True)
        for token_id in new_token_ids:
            if not 0 <= token_id < self._vocab_size:
                raise InvalidTokenIdError(
                    f"token id {token_id} is outside the vocabulary (size {self._vocab_size})"
                )
        token_texts = self._token_texts(new_token_ids) if self._with_token_texts else None
        self.num_output_tokens += len(new_token_ids)

        ids_to_decode = new_token_ids
        if stopped_by_token and finished and not self._params.include_stop_str_in_output:
            ids_to_decode = new_token_ids[:-1]
        for token_id in ids_to_decode:
            self._feed(token_id)
        if finished:
            self._unsent_text += self._flush_undecoded()

        scan = self._matcher.scan(self._unsent_text, final=finished)
        self._unsent_text = scan.held
        self._finished = finished or scan.stop_string is not None
        return DetokenizedDelta(scan.emit, token_texts, scan.stop_string, self._finished)

    def _feed(self, token_id: int) -> None:
        chunk = self._stream.step(self._tokenizer, token_id)
        if chunk is None:
            self._undecoded_ids.append(token_id)
            return
        self._unsent_text += chunk
        tail = [*self._decoded_tail_ids, *self._undecoded_ids, token_id]
        self._decoded_tail_ids = tail[-FLUSH_CONTEXT_TOKENS:]
        self._undecoded_ids.clear()

    def _flush_undecoded(self) -> str:
        """Text of ids the stream still holds (the output ended mid-character)."""
        if not self._undecoded_ids:
            return ""
        skip = self._params.skip_special_tokens
        undecoded_ids = self._undecoded_ids
        self._undecoded_ids = []
        context_text = self._tokenizer.decode(self._decoded_tail_ids, skip_special_tokens=skip)
        full_text = self._tokenizer.decode(
            [*self._decoded_tail_ids, *undecoded_ids], skip_special_tokens=skip
        )
        if full_text.startswith(context_text):
            return full_text[len(context_text) :]
        return self._tokenizer.decode(undecoded_ids, skip_special_tokens=skip)

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        # Each token on its own: a byte that is only part of a character shows
        # as U+FFFD, the usual rendering of such tokens in logprobs.
        return [self._tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    def _clean_prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last few ids, dropped if they end inside a UTF-8 character.

        A prompt cut mid-character would make the first output token complete
        a character that belongs half to the prompt; without context the output
        decodes exactly as ``tokenizer.decode(output_ids)``.
        """
        tail = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        context = [t for t in tail if 0 <= t < self._vocab_size]
        if not context:
            return []
        text = self._tokenizer.decode(context, skip_special_tokens=self._params.skip_special_tokens)
        if text.endswith(_REPLACEMENT_CHAR):
            return []
        return context
