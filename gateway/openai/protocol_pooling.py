"""Request and response bodies of the pooling APIs, as their clients send and expect them.

OpenAI's ``/v1/embeddings``; vLLM's ``/pooling``, ``/score`` and ``/classify``;
the Jina/Cohere rerank shape of ``/rerank``, ``/v1/rerank`` and ``/v2/rerank``.
Pydantic models, so the OpenAPI schema documents them.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvmesh.gateway.openai.protocol import prompt_batch_limit

TokenIds = list[int]
# Inputs of one call: at most --max-prompts-per-request (the served schema's maxItems).
Texts = Annotated[list[str], Field(json_schema_extra=prompt_batch_limit())]
# OpenAI's input: a string, strings, token ids, or lists of token ids.
EmbeddingInput = (
    str
    | Texts
    | TokenIds
    | Annotated[list[TokenIds], Field(json_schema_extra=prompt_batch_limit())]
)


class _PoolingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str | None = None
    # vLLM's: keep the first k tokens of each input (special tokens kept); None:
    # an input over the model's maximum is refused.
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    # vLLM's: lower values are scheduled first under --scheduling-policy priority.
    priority: int = 0
    user: str | None = None


class EmbeddingRequest(_PoolingRequest):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka: the embedding's first `dimensions` values (models that declare it).
    dimensions: int | None = Field(default=None, ge=1)
    # vLLM's: override the model's normalization.
    normalize: bool | None = None


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the model's pooled output, as /v1/embeddings computes it."""


class ScoreRequest(_PoolingRequest):
    """vLLM's /score: text_1 against each text_2 (or queries against documents)."""

    text_1: str | Texts | None = None
    text_2: str | Texts | None = None
    queries: str | Texts | None = None
    documents: str | Texts | None = None


class RerankRequest(_PoolingRequest):
    query: str
    documents: Texts
    # Keep the best top_n (None or 0: all), sorted by relevance.
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True


class ClassifyRequest(_PoolingRequest):
    input: str | Texts


class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # A list of floats, or base64 of little-endian float32 (encoding_format).
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: PoolingUsage


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassifyData(BaseModel):
    object: Literal["classify"] = "classify"
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassifyData]
    usage: PoolingUsage
