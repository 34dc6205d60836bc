"""Bound what one generation call may cost the engine, and refuse past it with a 400.

A schema-valid request could otherwise hold a 2-core server for as long as it
liked (issue 43: one chat call with ``n=2048`` kept the worker busy for over
ten minutes while every other request waited behind its 2,048 sequences).
Three bounds, each a flag a deployment chooses, each named in its refusal:

- ``--max-n``: choices per prompt (``n``, ``best_of``);
- ``--max-tokens-limit``: one choice's ``max_tokens`` (validation.py applies it,
  since the default it caps is computed there);
- ``--max-tokens-per-request``: over the call's prompts x n choices, prompt
  tokens plus ``max_tokens``: the most of the engine's batch and KV cache one
  call can hold, however it mixes prompts, n and length.

The prompt's own size is vLLM's ``--max-model-len`` (the scheduler's).
"""

from __future__ import annotations

from kvmesh.gateway.engine_params.limits import GatewayLimits
from kvmesh.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.services.contracts.errors import InvalidRequestError


def check_n(request: CompletionRequest | ChatCompletionRequest, limits: GatewayLimits) -> None:
    """Refuse ``n`` (or ``best_of``) past ``--max-n`` before anything is tokenized."""
    best_of = getattr(request, "best_of", None)
    for param, value in (("n", request.n), ("best_of", best_of)):
        if value is not None and value > limits.max_n:
            raise InvalidRequestError(
                f"{param}={value} is past this server's limit of {limits.max_n} choices per "
                "prompt (--max-n)",
                param=param,
                code="max_n_exceeded",
            )


def check_request_tokens(
    prompt_lens: list[int], max_tokens: list[int], n: int, limits: GatewayLimits
) -> None:
    """Refuse a call whose choices together may hold more than ``--max-tokens-per-request``
    tokens; ``prompt_lens`` and ``max_tokens`` have one entry per prompt."""
    total = n * sum(p + m for p, m in zip(prompt_lens, max_tokens, strict=True))
    if total > limits.max_tokens_per_request:
        raise InvalidRequestError(
            f"this request may hold {total} tokens ({len(prompt_lens)} prompt(s) x n={n}, "
            f"prompt + max_tokens each), past this server's limit of "
            f"{limits.max_tokens_per_request} (--max-tokens-per-request); lower n or max_tokens",
            param="max_tokens",
            code="max_tokens_per_request_exceeded",
        )
