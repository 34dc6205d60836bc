"""Embeddings, pooling, scores, reranking and classification over a pooling model.

Every input becomes one engine request whose SamplingParams carry
PoolingParams: the scheduler runs it whole in one step without KV blocks,
the worker's pooling runner answers its vector (an embedding, or the
classifier's logits) on the final delta. Requests of one call are submitted
together (MultiGeneration), so they share steps and are aborted together
when the client leaves. Validation happens here, before anything is queued:
a bad input is a 400 with an OpenAI-style body.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import time

import numpy as np

from kvmesh.gateway.engine.client import GenerationRequest, PoolingInfo
from kvmesh.gateway.openai.protocol_pooling import (
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from kvmesh.gateway.openai.serving_common import (
    Serving,
    failure_error,
    new_request_id,
    start_generation,
)
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.contracts.pooling_params import PoolingParams
from kvmesh.services.contracts.sampling_params import DetokenizeParams, SamplingParams


@dataclasses.dataclass(frozen=True)
class _Input:
    """One tokenized input; ``first_segment_len`` set for a (query, document) pair."""

    token_ids: list[int]
    first_segment_len: int | None = None


class PoolingServing(Serving):
    """The handlers of every pooling route."""

    # ---- checks --------------------------------------------------------------

    def _pooling_info(self, task: str, what: str) -> PoolingInfo:
        info = self._engine.model_info.pooling
        if info is None:
            raise InvalidRequestError(
                f"The model `{self._model_name}` is a generation model and does not support "
                f"{what}; serve a pooling model (an encoder checkpoint) for it.",
                param="model",
            )
        if task not in info.tasks:
            raise InvalidRequestError(
                f"The model `{self._model_name}` does not support {what} "
                f"(it serves: {', '.join(info.tasks)}).",
                param="model",
            )
        return info

    def _check_count(self, n: int, param: str) -> None:
        if n == 0:
            raise InvalidRequestError(f"'{param}' must not be empty.", param=param)
        limit = self._limits.max_prompts_per_request
        if n > limit:
            raise InvalidRequestError(
                f"'{param}' has {n} inputs; at most {limit} are allowed per request.",
                param=param,
            )

    def _check_tokens(self, inputs: list[_Input], param: str) -> None:
        max_len = self._engine.model_info.max_model_len
        vocab = self._tokenizer.vocab_size
        for item in inputs:
            ids = item.token_ids
            if not ids:
                raise InvalidRequestError(f"an input of '{param}' is empty.", param=param)
            if len(ids) > max_len:
                raise InvalidRequestError(
                    f"This model's maximum context length is {max_len} tokens. However, you "
                    f"requested {len(ids)} tokens in the input. Please reduce the length of the "
                    "input, or set truncate_prompt_tokens.",
                    param=param,
                )
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidRequestError(
                    f"token ids in '{param}' must be in [0, {vocab}).", param=param
                )

    def _check_dimensions(self, info: PoolingInfo, dimensions: int | None) -> None:
        if dimensions is None:
            return
        allowed = info.matryoshka_dimensions
        if not allowed:
            raise InvalidRequestError(
                f"The model `{self._model_name}` does not support Matryoshka representation; "
                "'dimensions' is not allowed.",
                param="dimensions",
            )
        if dimensions > info.embedding_dim or (-1 not in allowed and dimensions not in allowed):
            choices = (
                f"at most {info.embedding_dim}" if -1 in allowed else f"one of {list(allowed)}"
            )
            raise InvalidRequestError(
                f"'dimensions' {dimensions} is not supported; use {choices}.", param="dimensions"
            )

    # ---- tokenization --------------------------------------------------------

    def _encode(self, text: str, truncate: int | None) -> list[int]:
        hf = self._tokenizer._hf
        if truncate is None:
            return list(hf(text)["input_ids"])
        return list(hf(text, truncation=True, max_length=truncate)["input_ids"])

    def _encode_pair(self, first: str, second: str, truncate: int | None) -> _Input:
        hf = self._tokenizer._hf
        kwargs = {} if truncate is None else {"truncation": "only_second", "max_length": truncate}
        encoded = hf(first, second, **kwargs)
        # Segment ids as the tokenizer gives them to transformers: a BERT tokenizer marks
        # the second text with type 1; one that returns no token_type_ids (XLM-R, or a
        # tokenizer that does not list them) leaves every token at type 0.
        types = list(encoded.get("token_type_ids") or [])
        first_len = types.index(1) if 1 in types else None
        return _Input(list(encoded["input_ids"]), first_len)

    async def _texts_or_ids(
        self, raw: str | list, truncate: int | None, param: str
    ) -> list[_Input]:
        """OpenAI's input: a string, strings, token ids or lists of token ids."""
        if isinstance(raw, str):
            raw = [raw]
        # One list of token ids is one input, however many tokens it has.
        self._check_count(1 if raw and all(isinstance(x, int) for x in raw) else len(raw), param)
        if all(isinstance(x, int) for x in raw):
            token_lists = [list(raw)]
        elif all(isinstance(x, list) for x in raw):
            token_lists = [list(x) for x in raw]
        elif all(isinstance(x, str) for x in raw):
            texts = list(raw)
            token_lists = await self._tokenize(lambda: [self._encode(t, truncate) for t in texts])
            truncate = None  # done by the tokenizer, with the special tokens kept
        else:
            raise InvalidRequestError(
                f"'{param}' must be a string, a list of strings, a list of token ids or a list "
                "of lists of token ids.",
                param=param,
            )
        if truncate is not None:
            token_lists = [ids[:truncate] for ids in token_lists]
        inputs = [_Input(ids) for ids in token_lists]
        self._check_tokens(inputs, param)
        return inputs

    # ---- running -------------------------------------------------------------

    async def _run(
        self, prefix: str, inputs: list[_Input], params: PoolingParams, priority: int
    ) -> tuple[str, list[np.ndarray], int]:
        """(request id, each input's vector, prompt tokens) with every input in flight at once."""
        request_id = new_request_id(prefix)
        requests = [
            GenerationRequest(
                request_id=f"{request_id}-{i}",
                prompt_token_ids=item.token_ids,
                sampling_params=SamplingParams(
                    max_tokens=1,
                    pooling=dataclasses.replace(params, first_segment_len=item.first_segment_len),
                ),
                detokenize_params=DetokenizeParams(),
                priority=priority,
            )
            for i, item in enumerate(inputs)
        ]
        generation = await start_generation(self._engine, requests, self._metrics, self._model_name)
        vectors: list[np.ndarray | None] = [None] * len(inputs)
        try:
            async for index, delta in generation.deltas():
                error = failure_error(delta)
                if error is not None:
                    raise error
                if delta.finished:
                    if not delta.pooled_data:
                        raise InvalidRequestError("the engine returned no pooled output")
                    vectors[index] = np.frombuffer(delta.pooled_data, dtype="<f4")
        finally:
            await generation.close()
        num_tokens = sum(len(item.token_ids) for item in inputs)
        return request_id, [v for v in vectors if v is not None], num_tokens

    async def _embed(
        self, request: EmbeddingRequest, prefix: str
    ) -> tuple[str, list[np.ndarray], int]:
        self._models.resolve(request.model)
        info = self._pooling_info("embed", "embeddings")
        self._check_dimensions(info, request.dimensions)
        inputs = await self._texts_or_ids(request.input, request.truncate_prompt_tokens, "input")
        params = PoolingParams(
            task="embed", dimensions=request.dimensions, normalize=request.normalize
        )
        return await self._run(prefix, inputs, params, request.priority)

    @staticmethod
    def _encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode()
        return vector.tolist()

    # ---- routes --------------------------------------------------------------

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        _, vectors, num_tokens = await self._embed(request, "embd")
        return EmbeddingResponse(
            data=[
                EmbeddingData(index=i, embedding=self._encode_vector(v, request.encoding_format))
                for i, v in enumerate(vectors)
            ],
            model=self._model_name,
            usage=PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse:
        request_id, vectors, num_tokens = await self._embed(request, "pool")
        return PoolingResponse(
            id=request_id,
            model=self._model_name,
            data=[
                PoolingData(index=i, data=self._encode_vector(v, request.encoding_format))
                for i, v in enumerate(vectors)
            ],
            usage=PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    async def _scores(
        self, first: list[str], second: list[str], truncate: int | None, priority: int
    ) -> tuple[str, list[float], int]:
        """Scores of pairs (first[i], second[i]); a single first text is paired with each second.

        A cross-encoder scores each pair in one forward (sigmoid of its one
        logit, as sentence-transformers' CrossEncoder); an embedding model
        scores the cosine of the two embeddings (vLLM's bi-encoder score).
        """
        self._check_count(len(first), "text_1")
        self._check_count(len(second), "text_2")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise InvalidRequestError(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
                "many as text_2.",
                param="text_1",
            )
        self._check_count(len(second), "text_2")
        info = self._engine.model_info.pooling
        if info is not None and "classify" in info.tasks:
            if len(info.labels) != 1:
                raise InvalidRequestError(
                    f"scoring needs a one-label cross-encoder; this model has {len(info.labels)} "
                    "labels (use /classify).",
                    param="model",
                )
            pairs = await self._tokenize(
                lambda: [
                    self._encode_pair(a, b, truncate) for a, b in zip(first, second, strict=True)
                ]
            )
            self._check_tokens(pairs, "text_2")
            request_id, logits, num_tokens = await self._run(
                "score", pairs, PoolingParams(task="classify"), priority
            )
            return request_id, [_sigmoid(float(v[0])) for v in logits], num_tokens
        self._pooling_info("embed", "scoring")
        unique = list(dict.fromkeys([*first, *second]))
        inputs = await self._texts_or_ids(unique, truncate, "text_1")
        request_id, vectors, num_tokens = await self._run(
            "score", inputs, PoolingParams(task="embed", normalize=True), priority
        )
        by_text = dict(zip(unique, vectors, strict=True))
        scores = [float(np.dot(by_text[a], by_text[b])) for a, b in zip(first, second, strict=True)]
        return request_id, scores, num_tokens

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        self._models.resolve(request.model)
        first = request.text_1 if request.text_1 is not None else request.queries
        second = request.text_2 if request.text_2 is not None else request.documents
        if first is None or second is None:
            raise InvalidRequestError(
                "give text_1 and text_2 (or queries and documents).", param="text_1"
            )
        first = [first] if isinstance(first, str) else list(first)
        second = [second] if isinstance(second, str) else list(second)
        request_id, scores, num_tokens = await self._scores(
            first, second, request.truncate_prompt_tokens, request.priority
        )
        return ScoreResponse(
            id=request_id,
            model=self._model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    async def create_rerank(self, request: RerankRequest) -> RerankResponse:
        self._models.resolve(request.model)
        if not request.documents:
            raise InvalidRequestError("'documents' must not be empty.", param="documents")
        request_id, scores, num_tokens = await self._scores(
            [request.query],
            list(request.documents),
            request.truncate_prompt_tokens,
            request.priority,
        )
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        if request.top_n:
            order = order[: request.top_n]
        return RerankResponse(
            id=request_id,
            model=self._model_name,
            usage=RerankUsage(total_tokens=num_tokens),
            results=[
                RerankResult(
                    index=i,
                    relevance_score=scores[i],
                    document=(
                        RerankDocument(text=request.documents[i])
                        if request.return_documents
                        else None
                    ),
                )
                for i in order
            ],
        )

    async def create_classify(self, request: ClassifyRequest) -> ClassifyResponse:
        self._models.resolve(request.model)
        info = self._pooling_info("classify", "classification")
        inputs = await self._texts_or_ids(request.input, request.truncate_prompt_tokens, "input")
        request_id, logits, num_tokens = await self._run(
            "classify", inputs, PoolingParams(task="classify"), request.priority
        )
        data = []
        for i, row in enumerate(logits):
            probs = _probabilities(row)
            best = int(np.argmax(probs)) if len(probs) > 1 else 0
            data.append(
                ClassifyData(index=i, label=info.labels[best], probs=probs, num_classes=len(probs))
            )
        return ClassifyResponse(
            id=request_id,
            created=int(time.time()),
            model=self._model_name,
            data=data,
            usage=PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _probabilities(logits: np.ndarray) -> list[float]:
    """Softmax over the labels; one label: its sigmoid (as vLLM and CrossEncoder)."""
    if len(logits) == 1:
        return [_sigmoid(float(logits[0]))]
    shifted = np.exp(logits - logits.max())
    return (shifted / shifted.sum()).astype(float).tolist()
