"""The gateway's only view of the engine: submit a request, stream its deltas, abort it.

The HTTP layer (``gateway/openai/app.py``) and the public gRPC servicer depend on the
``EngineClient`` protocol alone, so they run unchanged against the gRPC client
(``gateway/engine/grpc_client.py``) in production and a fake engine in tests.

Contract for implementations:

- ``generate`` yields one ``GenerationDelta`` per engine step in which the
  request produced news, and its last delta has ``finish_reason`` set. It
  raises a ``kvmesh.services.contracts.errors.KvmeshError`` before yielding anything when the
  request cannot be admitted (engine unreachable: ``UnavailableError``, queue
  full: ``OverloadedError``, rejected: ``InvalidRequestError``). A failure
  after admission is reported in-band as a final delta with
  ``finish_reason="error"`` and ``error`` set.
- Texts in deltas are already detokenized and stop-truncated: concatenating
  every delta's ``text`` gives the final output text.
- ``abort`` is idempotent and never raises for an unknown or finished id; the
  gateway calls it whenever a client goes away before the final delta.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.sampling_params import DetokenizeParams, SamplingParams


@dataclass
class GenerationRequest:
    """One sequence to generate; ``n > 1`` is fanned out by the gateway into several."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    detokenize_params: DetokenizeParams
    # vLLM's convention: lower values are scheduled earlier under a priority policy.
    priority: int = 0
    # Mixed into prefix-cache block hashes so tenants cannot probe each other's cache.
    cache_salt: str | None = None
    # Shared by the n > 1 samples of one prompt: the scheduler computes the
    # prompt once for the first of them and lets the others hit its cached KV.
    parallel_group: str | None = None
    # The LoRA adapter ``model`` named (gateway/engine_params/served_models.py);
    # None: the base model.
    lora_request: LoRARequest | None = None


@dataclass(frozen=True)
class TopLogprob:
    """One alternative token at a position."""

    token_id: int
    token: str  # the token's text, as the detokenizer decodes it alone
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled (or prompt) token at one position and its top alternatives."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = field(default_factory=list)
    # 1-based rank of token_id in the model's distribution (None: not reported).
    rank: int | None = None


@dataclass
class GenerationDelta:
    """One engine step's news for one request."""

    request_id: str
    text: str  # new text this step, already stop-truncated
    token_ids: list[int]  # new token ids this step
    # The OpenAI string of kvmesh.services.contracts.finish_reason.FinishReason (its ``.value``);
    # None while the request goes on.
    finish_reason: str | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int  # total generated so far
    # Per new token (parallel to token_ids); None when logprobs were not requested.
    logprobs: list[TokenLogprob] | None
    error: str | None = None
    # On the first delta of a request with prompt_logprobs set: one entry per
    # prompt token, None for the first (nothing precedes it). None otherwise.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling request's result on its final delta (little-endian float32);
    # None for generation requests.
    pooled_data: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class PoolingInfo:
    """What a pooling model serves (WorkerInfo fields 19-23), for validation."""

    tasks: tuple[str, ...]  # "embed", "classify"
    embedding_dim: int
    # Matryoshka sizes `dimensions` may take; (-1,): any up to embedding_dim; (): none.
    matryoshka_dimensions: tuple[int, ...] = ()
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway needs to know about the served model."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # Requests the engine holds at once, running plus waiting (None: unknown);
    # the default bound of a gateway's calls in flight (gateway/admission.py).
    capacity: int | None = None
    # Tokens per KV block of the engine's prefix cache (None: unknown); a
    # router must hash prompts in blocks of this size to match its cache.
    kv_block_size: int | None = None
    # The engine's compute dtype and why (empty: unknown), for /v1/models.
    dtype: str = ""
    dtype_reason: str = ""
    # How the engine holds its weights: "gguf", "int8" (empty: as the checkpoint has them).
    quantization: str = ""
    # Set when the engine runs a pooling model (embeddings, scores); None: generation.
    pooling: PoolingInfo | None = None
    # Bytes of weights resident in the worker (None: unknown), for /v1/models.
    weight_bytes: int | None = None
    # Whether the engine runs in batch-invariant mode (--batch-invariant).
    batch_invariant: bool = False


@runtime_checkable
class EngineClient(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Submit ``request`` and stream its deltas; raises ``KvmeshError`` if refused.

        Implemented as an async generator (``async def`` with ``yield``), so
        calling it returns the iterator directly.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its resources; a no-op for unknown ids."""
        ...

    async def check_ready(self) -> None:
        """Raise ``KvmeshError`` unless a scheduler/worker round trip succeeds."""
        ...

    @property
    def model_info(self) -> ModelInfo: ...
