"""The engine's per-token logprobs in OpenAI's two response formats.

Completions use the legacy columnar shape (``tokens``, ``token_logprobs``,
``top_logprobs`` as ``{token: logprob}`` dicts, ``text_offset`` in characters);
chat uses one object per token with UTF-8 ``bytes`` and a ranked
``top_logprobs`` list.
"""

from __future__ import annotations

import math

from gateway.engine_client import TokenLogprob
from gateway.protocol import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs

# JSON has no -inf; OpenAI clients expect a number, vLLM sends this floor too.
_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def completion_logprobs(
    logprobs: list[TokenLogprob], num_top: int, text_offset: int
) -> CompletionLogprobs:
    """Columnar logprobs for tokens whose text starts at ``text_offset`` in the choice."""
    result = CompletionLogprobs()
    offset = text_offset
    for entry in logprobs:
        result.tokens.append(entry.token)
        result.token_logprobs.append(_finite(entry.logprob))
        result.text_offset.append(offset)
        offset += len(entry.token)
        top = {alt.token: _finite(alt.logprob) for alt in entry.top_logprobs[:num_top]}
        # OpenAI always reports the sampled token, so a dict may hold num_top + 1 entries.
        top.setdefault(entry.token, _finite(entry.logprob))
        result.top_logprobs.append(top)
    return result


def chat_logprobs(logprobs: list[TokenLogprob], num_top: int) -> ChatLogprobs:
    content = [
        ChatTokenLogprob(
            token=entry.token,
            logprob=_finite(entry.logprob),
            bytes=list(entry.token.encode("utf-8")),
            top_logprobs=[
                ChatTopLogprob(
                    token=alt.token,
                    logprob=_finite(alt.logprob),
                    bytes=list(alt.token.encode("utf-8")),
                )
                for alt in entry.top_logprobs[:num_top]
            ],
        )
        for entry in logprobs
    ]
    return ChatLogprobs(content=content)
