"""The engine's per-token logprobs in OpenAI's two response formats, and vLLM's prompt_logprobs.

Completions use the legacy columnar shape (``tokens``, ``token_logprobs``,
``top_logprobs`` as ``{token: logprob}`` dicts, ``text_offset`` in characters);
with ``echo`` the prompt's tokens come first, the first of them with ``null``
logprob and alternatives, as OpenAI answers. Chat uses one object per token
with UTF-8 ``bytes`` and a ranked ``top_logprobs`` list. vLLM's
``prompt_logprobs`` maps token ids to ``{logprob, rank, decoded_token}`` per
prompt position. ``as_token_ids`` is vLLM's ``return_tokens_as_token_ids``:
tokens are named ``token_id:<id>`` instead of by their text, so that tokens
that are not valid UTF-8 on their own stay distinguishable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvmesh.gateway.engine.client import TokenLogprob
from kvmesh.gateway.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)

# JSON has no -inf; OpenAI clients expect a number, vLLM sends this floor too.
_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def token_name(token_id: int, text: str, as_token_ids: bool) -> str:
    return f"token_id:{token_id}" if as_token_ids else text


def completion_logprobs(
    logprobs: Sequence[TokenLogprob],
    num_top: int,
    text_offset: int,
    as_token_ids: bool = False,
) -> CompletionLogprobs:
    """Columnar logprobs for tokens whose text starts at ``text_offset`` in the choice."""
    result = CompletionLogprobs()
    offset = text_offset
    for entry in logprobs:
        name = token_name(entry.token_id, entry.token, as_token_ids)
        result.tokens.append(name)
        result.token_logprobs.append(_finite(entry.logprob))
        result.text_offset.append(offset)
        offset += len(entry.token)
        top = {
            token_name(alt.token_id, alt.token, as_token_ids): _finite(alt.logprob)
            for alt in entry.top_logprobs[:num_top]
        }
        # OpenAI always reports the sampled token, so a dict may hold num_top + 1 entries.
        top.setdefault(name, _finite(entry.logprob))
        result.top_logprobs.append(top)
    return result


def echo_logprobs(
    prompt_token_ids: list[int],
    first_token_text: str,
    prompt_logprobs: Sequence[TokenLogprob | None],
    num_top: int,
    as_token_ids: bool = False,
) -> CompletionLogprobs:
    """The echoed prompt's columnar logprobs (OpenAI's echo + logprobs), from offset 0.

    The first prompt token has nothing before it: ``null`` logprob and alternatives.
    """
    scored = [entry for entry in prompt_logprobs[1:] if entry is not None]
    if len(scored) != len(prompt_token_ids) - 1:
        raise ValueError("prompt logprobs do not cover the prompt")
    result = CompletionLogprobs(
        tokens=[token_name(prompt_token_ids[0], first_token_text, as_token_ids)],
        token_logprobs=[None],
        top_logprobs=[None],
        text_offset=[0],
    )
    rest = completion_logprobs(scored, num_top, len(first_token_text), as_token_ids)
    return concat_logprobs(result, rest)


def concat_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def vllm_prompt_logprobs(
    prompt_logprobs: Sequence[TokenLogprob | None], num_top: int
) -> PromptLogprobs:
    """vLLM's layout: per position the prompt token, then the top ``num_top`` alternatives."""
    result: PromptLogprobs = []
    for entry in prompt_logprobs:
        if entry is None:
            result.append(None)
            continue
        position = {
            str(entry.token_id): PromptLogprob(
                logprob=_finite(entry.logprob), rank=entry.rank, decoded_token=entry.token
            )
        }
        for rank, alt in enumerate(entry.top_logprobs[:num_top], start=1):
            position.setdefault(
                str(alt.token_id),
                PromptLogprob(logprob=_finite(alt.logprob), rank=rank, decoded_token=alt.token),
            )
        result.append(position)
    return result


def chat_logprobs(
    logprobs: list[TokenLogprob], num_top: int, as_token_ids: bool = False
) -> ChatLogprobs:
    content = []
    for entry in logprobs:
        name = token_name(entry.token_id, entry.token, as_token_ids)
        top = []
        for alt in entry.top_logprobs[:num_top]:
            alt_name = token_name(alt.token_id, alt.token, as_token_ids)
            top.append(
                ChatTopLogprob(
                    token=alt_name,
                    logprob=_finite(alt.logprob),
                    bytes=list(alt_name.encode("utf-8")),
                )
            )
        content.append(
            ChatTokenLogprob(
                token=name,
                logprob=_finite(entry.logprob),
                bytes=list(name.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)
