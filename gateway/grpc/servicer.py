"""The public gRPC API (kvmesh.v1.Generation), served next to the HTTP API.

A GenerateRequest is mapped onto the same pydantic CompletionRequest the HTTP
API validates, so both APIs accept and refuse exactly the same inputs. Errors
are raised, never aborted with here: the server's interceptor
(``kvmesh.services.runtime.grpc_server``) gives each its kind's status, so a refusal is
INVALID_ARGUMENT with the offending parameter named, and a bug is INTERNAL.
Cancelling the call aborts the request.
"""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pydantic

from kvmesh.gateway.admission import AdmissionGate
from kvmesh.gateway.engine.client import EngineClient, GenerationDelta
from kvmesh.gateway.engine.generation_stream import MultiGeneration
from kvmesh.gateway.engine_params.limits import GatewayLimits
from kvmesh.gateway.engine_params.served_models import ServedModels
from kvmesh.gateway.engine_params.validation import (
    check_unsupported,
    completion_prompts,
    render_chat,
)
from kvmesh.gateway.metrics import GatewayMetrics
from kvmesh.gateway.openai.errors import invalid_request_from_validation
from kvmesh.gateway.openai.protocol import ChatMessage, CompletionRequest
from kvmesh.gateway.openai.protocol_pooling import EmbeddingRequest
from kvmesh.gateway.openai.serving_common import (
    ServingContext,
    build_engine_requests,
    start_generation,
)
from kvmesh.gateway.openai.serving_pooling import PoolingServing
from kvmesh.gateway.request_cost import check_n
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.protos import generation_pb2, generation_pb2_grpc
from kvmesh.services.contracts.errors import (
    InvalidRequestError,
    UnauthenticatedError,
    UnavailableError,
)
from kvmesh.services.runtime.tracing import Tracing, span_or_nothing

logger = logging.getLogger(__name__)

_OPTIONAL_SAMPLING_FIELDS = (
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "top_n_sigma",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "skip_special_tokens",
    "logprobs",
)


_CHAT_MESSAGES = pydantic.TypeAdapter(list[ChatMessage])


def chat_prompt_ids(msg: generation_pb2.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """A ``messages`` prompt rendered as /v1/chat/completions renders one, as token
    ids (the template writes its own BOS). Raises InvalidRequestError."""
    body = [{"role": m.role, "content": m.content} for m in msg.messages.messages]
    if not body:
        raise InvalidRequestError("messages must not be empty", param="messages")
    try:
        messages = _CHAT_MESSAGES.validate_python(body)
    except pydantic.ValidationError as exc:
        raise invalid_request_from_validation(exc.errors(), body) from None
    add_generation_prompt = (
        msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True
    )
    text = render_chat(
        messages,
        tokenizer,
        add_generation_prompt,
        continue_final_message=msg.continue_final_message,
    )
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    if not token_ids:
        raise InvalidRequestError("messages rendered to an empty prompt", param="messages")
    return token_ids


def completion_request_from_proto(
    msg: generation_pb2.GenerateRequest, chat_token_ids: list[int] | None = None
) -> CompletionRequest:
    """The HTTP API's request for ``msg``; ``chat_token_ids``: its rendered ``messages``."""
    sampling = msg.sampling
    kind = msg.WhichOneof("prompt")
    prompt: str | list[int]
    if kind == "text":
        prompt = msg.text
    elif kind == "messages":
        if chat_token_ids is None:
            raise ValueError("a messages prompt must be rendered first (chat_prompt_ids)")
        prompt = chat_token_ids
    else:
        prompt = list(msg.token_ids.ids)
    body: dict[str, Any] = {
        "prompt": prompt,
        "ignore_eos": sampling.ignore_eos,
        "stop_token_ids": list(sampling.stop_token_ids),
        "stop": list(sampling.stop),
        "include_stop_str_in_output": sampling.include_stop_str_in_output,
        "priority": msg.priority,
        "echo": sampling.echo,
    }
    if sampling.user:
        body["user"] = sampling.user
    constraint = sampling.WhichOneof("structured_output")
    if constraint == "json_schema":
        body["structured_outputs"] = {"json": sampling.json_schema}
    elif constraint == "json_object":
        body["structured_outputs"] = {"json_object": sampling.json_object}
    elif constraint == "choice":
        body["structured_outputs"] = {"choice": list(sampling.choice.choices)}
    elif constraint in ("regex", "grammar"):
        body["structured_outputs"] = {constraint: getattr(sampling, constraint)}
    for name in _OPTIONAL_SAMPLING_FIELDS:
        if sampling.HasField(name):
            body[name] = getattr(sampling, name)
    if sampling.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in sampling.logit_bias.items()}
    if msg.HasField("cache_salt"):
        body["cache_salt"] = msg.cache_salt
    try:
        return CompletionRequest.model_validate(body)
    except pydantic.ValidationError as exc:
        raise invalid_request_from_validation(exc.errors(), body) from None


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        model_name: str,
        metrics: GatewayMetrics | None = None,
        api_key: str | None = None,
        limits: GatewayLimits | None = None,
        admission: AdmissionGate | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits or GatewayLimits()
        # The same gate as the HTTP API's: one bound for the gateway's calls.
        self.admission = admission
        # Same rule as the HTTP API: with a key, every call must carry
        # "authorization: Bearer <key>" metadata (health/reflection stay open).
        self._expected_auth = f"Bearer {api_key}".encode() if api_key else None
        # The same vllm:* series as the HTTP API: one model, one set of counters.
        self.metrics = metrics or GatewayMetrics.for_registry()
        # With --otlp-traces-endpoint: the tokenize span under Generate's server span.
        self.tracing = tracing
        # Embed answers as the HTTP API's /v1/embeddings does.
        self.pooling = PoolingServing(
            ServingContext(
                engine,
                tokenizer,
                model_name,
                self.metrics,
                self.limits,
                ServedModels(model_name),
                tracing,
            )
        )

    def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        if self._expected_auth is None:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), self._expected_auth):
            raise UnauthenticatedError("invalid or missing API key", code="invalid_api_key")

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self._check_auth(context)
        if self.admission is not None and not self.admission.try_enter():
            raise self.admission.refusal()
        try:
            async for response in self._generate(request):
                yield response
        finally:
            if self.admission is not None:
                self.admission.leave()

    async def _generate(
        self, request: generation_pb2.GenerateRequest
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        if request.WhichOneof("prompt") is None:
            raise InvalidRequestError("prompt is required", param="prompt")
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        generation: MultiGeneration | None = None
        try:
            chat_token_ids = None
            if request.WhichOneof("prompt") == "messages":
                with span_or_nothing(self.tracing, "render_chat"):
                    chat_token_ids = await self.tokenizer.offload(
                        chat_prompt_ids, request, self.tokenizer
                    )
            completion = completion_request_from_proto(request, chat_token_ids)
            check_unsupported(completion)
            check_n(completion, self.limits)  # before the prompts are tokenized
            with span_or_nothing(self.tracing, "tokenize"):
                prompts = await self.tokenizer.offload(
                    completion_prompts,
                    completion,
                    self.tokenizer,
                    self.limits.max_prompts_per_request,
                )
            engine_requests = build_engine_requests(
                request_id,
                prompts,
                completion,
                self.engine.model_info,
                self.tokenizer,
                self.limits,
            )
            if completion.n == 1:
                # A single sample keeps the caller's id end to end.
                engine_requests[0].request_id = request_id
            generation = await start_generation(
                self.engine, engine_requests, self.metrics, self.model_name
            )
            echoed: set[int] = set()
            async for index, delta in generation.deltas():
                text = delta.text
                if completion.echo and index not in echoed:
                    echoed.add(index)
                    text = prompts[0].text + text
                if delta.finish_reason == "error":
                    raise UnavailableError(delta.error or "generation failed")
                yield self._response(request_id, index, delta, text)
        finally:
            if generation is not None:
                await generation.close()

    @staticmethod
    def _response(
        request_id: str, index: int, delta: GenerationDelta, text: str
    ) -> generation_pb2.GenerateResponse:
        response = generation_pb2.GenerateResponse(
            request_id=request_id,
            index=index,
            token_ids=delta.token_ids,
            text=text,
            finish_reason=delta.finish_reason or "",
        )
        if isinstance(delta.stop_reason, str):
            response.stop_string = delta.stop_reason
        elif isinstance(delta.stop_reason, int):
            response.stop_token_id = delta.stop_reason
        if delta.logprobs:
            response.logprobs.extend(
                generation_pb2.TokenLogprob(
                    token_id=lp.token_id,
                    logprob=lp.logprob,
                    top_token_ids=[t.token_id for t in lp.top_logprobs],
                    top_logprobs=[t.logprob for t in lp.top_logprobs],
                )
                for lp in delta.logprobs
            )
        if delta.finished:
            response.usage.CopyFrom(
                generation_pb2.Usage(
                    prompt_tokens=delta.num_prompt_tokens,
                    completion_tokens=delta.num_output_tokens,
                    total_tokens=delta.num_prompt_tokens + delta.num_output_tokens,
                    cached_tokens=delta.num_cached_tokens,
                )
            )
        return response

    async def Tokenize(self, request, context):
        self._check_auth(context)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        token_ids = await self.tokenizer.offload(self.tokenizer.encode, request.text, add_special)
        return generation_pb2.TokenizeResponse(token_ids=token_ids)

    async def Embed(
        self, request: generation_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.EmbedResponse:
        self._check_auth(context)
        if self.admission is not None and not self.admission.try_enter():
            raise self.admission.refusal()
        try:
            return await self._embed(request)
        finally:
            if self.admission is not None:
                self.admission.leave()

    async def _embed(self, request: generation_pb2.EmbedRequest) -> generation_pb2.EmbedResponse:
        if request.texts and request.token_ids:
            raise InvalidRequestError("give texts or token_ids, not both", param="texts")
        inputs: list[str] | list[list[int]] = (
            list(request.texts) if request.texts else [list(t.ids) for t in request.token_ids]
        )
        try:
            body = EmbeddingRequest(
                input=inputs,
                encoding_format="float",
                dimensions=request.dimensions if request.HasField("dimensions") else None,
                normalize=request.normalize if request.HasField("normalize") else None,
                truncate_prompt_tokens=(
                    request.truncate_prompt_tokens
                    if request.HasField("truncate_prompt_tokens")
                    else None
                ),
                priority=request.priority,
            )
        except pydantic.ValidationError as exc:
            raise invalid_request_from_validation(exc.errors()) from None
        result = await self.pooling.create_embedding(body)
        return generation_pb2.EmbedResponse(
            embeddings=[generation_pb2.Embedding(values=d.embedding) for d in result.data],
            usage=generation_pb2.Usage(
                prompt_tokens=result.usage.prompt_tokens, total_tokens=result.usage.total_tokens
            ),
        )

    async def GetModelInfo(self, request, context):
        self._check_auth(context)
        info = self.engine.model_info
        return generation_pb2.ModelInfo(
            model_name=info.served_model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
        )
