"""``kvmesh.Client`` and ``kvmesh.AsyncClient``: the public gRPC ``Generate`` stream
without protobuf in the caller's code.

They speak ``kvmesh.v1.Generation`` (protos/generation.proto) to a gateway's
gRPC port (``kvmesh up``: 127.0.0.1:50051): a prompt (text, token ids, or chat
messages the server renders with the model's template) and a
``kvmesh.SamplingParams`` go in; text and token ids come out, streamed as
``StreamChunk``s or gathered into one ``RequestOutput`` per call, the shape
``kvmesh.LLM`` returns. Errors come back as ``ClientError`` carrying the gRPC
status name and the server's message (INVALID_ARGUMENT for bad input,
RESOURCE_EXHAUSTED when the gateway is full, UNAVAILABLE when the engine is).

    with kvmesh.Client("127.0.0.1:50051") as client:
        out = client.generate("The capital of France is", kvmesh.SamplingParams(max_tokens=8))
        print(out.outputs[0].text)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvmesh.outputs import CompletionOutput, RequestOutput
from kvmesh.protos import generation_pb2, generation_pb2_grpc
from kvmesh.sampling_params import SamplingParams
from kvmesh.services.runtime.grpc_server import public_aio_channel, public_channel

DEFAULT_TARGET = "127.0.0.1:50051"

# A prompt: text, token ids, or a conversation of {"role", "content"} messages
# (rendered by the server with the model's chat template).
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


class ClientError(RuntimeError):
    """A call the server refused or failed; ``code`` is the gRPC status name
    ("INVALID_ARGUMENT", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "UNAVAILABLE", ...)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class StreamChunk:
    """What one engine step added to one sample."""

    # Which of the prompt's `n` samples this belongs to.
    index: int
    text: str
    token_ids: list[int]
    # Set on the sample's last chunk: "stop" or "length".
    finish_reason: str | None
    # The stop_token_ids entry or stop string that ended it (None for EOS).
    stop_reason: int | str | None
    # On the last chunk: tokens of the prompt, of the sample, and prompt
    # tokens served from the prefix cache.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True)
class ChatOptions:
    """How the server renders a conversation (OpenAI chat's and vLLM's options)."""

    # End the prompt with the opening of the assistant's turn.
    add_generation_prompt: bool = True
    # Leave the last message open so the model continues it.
    continue_final_message: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway serves."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]


class Client:
    """A blocking client of one gateway's public gRPC API.

    ``target``: "host:port". ``api_key``: the gateway's ``--api-key`` (sent as
    ``authorization: Bearer``). ``root_certificates``: the PEM (bytes or a file
    path) that signs a gateway serving TLS (``--ssl-certfile``); None: plaintext.
    ``timeout``: seconds per call (None: no deadline).
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        root_certificates: bytes | str | Path | None = None,
        timeout: float | None = None,
    ) -> None:
        credentials = _credentials(root_certificates)
        self._channel = public_channel(target, credentials)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._metadata = _metadata(api_key)
        self.timeout = timeout

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str = "",
        priority: int = 0,
        chat_options: ChatOptions | None = None,
    ) -> Iterator[StreamChunk]:
        """Yield text and token ids as the engine produces them (one chunk per
        sample per step). Closing the iterator early cancels the request.
        ``prompt``: text, token ids, or chat messages (``chat_options`` say how
        the server renders them)."""
        call = self._stub.Generate(
            _request(prompt, params, request_id, priority, chat_options),
            timeout=self.timeout,
            metadata=self._metadata,
        )
        try:
            for response in call:
                yield _chunk(response)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()  # a no-op once the stream ended

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str = "",
        priority: int = 0,
    ) -> RequestOutput:
        """The whole generation for one prompt: every sample's text and token ids."""
        gather = _Gather(prompt, params, request_id)
        for chunk in self.stream(prompt, params, request_id=request_id, priority=priority):
            gather.add(chunk)
        return gather.result()

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        request_id: str = "",
        priority: int = 0,
    ) -> RequestOutput:
        """The reply to a conversation, rendered by the server with the model's chat
        template as /v1/chat/completions renders it."""
        options = ChatOptions(add_generation_prompt, continue_final_message)
        gather = _Gather(messages, params, request_id)
        for chunk in self.stream(
            messages, params, request_id=request_id, priority=priority, chat_options=options
        ):
            gather.add(chunk)
        return gather.result()

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The served model's token ids for ``text``."""
        try:
            response = self._stub.Tokenize(
                generation_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return list(response.token_ids)

    def model_info(self) -> ModelInfo:
        try:
            info = self._stub.GetModelInfo(
                generation_pb2.GetModelInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return _model_info(info)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient:
    """``Client`` for asyncio code: the same calls, awaited; ``stream`` is an async iterator."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        root_certificates: bytes | str | Path | None = None,
        timeout: float | None = None,
    ) -> None:
        credentials = _credentials(root_certificates)
        self._channel = public_aio_channel(target, credentials)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._metadata = _metadata(api_key)
        self.timeout = timeout

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str = "",
        priority: int = 0,
        chat_options: ChatOptions | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Yield chunks as the engine produces them; leaving early cancels the request."""
        call = self._stub.Generate(
            _request(prompt, params, request_id, priority, chat_options),
            timeout=self.timeout,
            metadata=self._metadata,
        )
        try:
            async for response in call:
                yield _chunk(response)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str = "",
        priority: int = 0,
    ) -> RequestOutput:
        gather = _Gather(prompt, params, request_id)
        async for chunk in self.stream(prompt, params, request_id=request_id, priority=priority):
            gather.add(chunk)
        return gather.result()

    async def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        request_id: str = "",
        priority: int = 0,
    ) -> RequestOutput:
        options = ChatOptions(add_generation_prompt, continue_final_message)
        gather = _Gather(messages, params, request_id)
        async for chunk in self.stream(
            messages, params, request_id=request_id, priority=priority, chat_options=options
        ):
            gather.add(chunk)
        return gather.result()

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            response = await self._stub.Tokenize(
                generation_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return list(response.token_ids)

    async def model_info(self) -> ModelInfo:
        try:
            info = await self._stub.GetModelInfo(
                generation_pb2.GetModelInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return _model_info(info)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class _Gather:
    """Chunks of one call -> one RequestOutput."""

    def __init__(self, prompt: Prompt, params: SamplingParams | None, request_id: str) -> None:
        self._prompt = prompt
        self._request_id = request_id
        num_samples = (params or SamplingParams()).n
        self._text: list[list[str]] = [[] for _ in range(num_samples)]
        self._ids: list[list[int]] = [[] for _ in range(num_samples)]
        self._ends: dict[int, StreamChunk] = {}

    def add(self, chunk: StreamChunk) -> None:
        self._text[chunk.index].append(chunk.text)
        self._ids[chunk.index].extend(chunk.token_ids)
        if chunk.finish_reason:
            self._ends[chunk.index] = chunk

    def result(self) -> RequestOutput:
        outputs = []
        for index, (text, ids) in enumerate(zip(self._text, self._ids, strict=True)):
            end = self._ends.get(index)
            outputs.append(
                CompletionOutput(
                    index,
                    "".join(text),
                    ids,
                    end.finish_reason if end else None,
                    end.stop_reason if end else None,
                )
            )
        prompt_ids = [] if isinstance(self._prompt, str) or _is_chat(self._prompt) else self._prompt
        return RequestOutput(
            self._request_id,
            self._prompt if isinstance(self._prompt, str) else None,
            [int(t) for t in prompt_ids],  # type: ignore[union-attr]
            outputs,
        )


def _is_chat(prompt: Prompt) -> bool:
    return not isinstance(prompt, str) and len(prompt) > 0 and isinstance(prompt[0], Mapping)


def _request(
    prompt: Prompt,
    params: SamplingParams | None,
    request_id: str,
    priority: int,
    chat_options: ChatOptions | None = None,
) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(
        request_id=request_id,
        sampling=_sampling_proto(params or SamplingParams()),
        priority=priority,
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif _is_chat(prompt):
        options = chat_options or ChatOptions()
        request.messages.messages.extend(
            generation_pb2.ChatMessage(role=m["role"], content=m.get("content", ""))
            for m in prompt  # type: ignore[union-attr]
        )
        request.add_generation_prompt = options.add_generation_prompt
        request.continue_final_message = options.continue_final_message
    else:
        request.token_ids.ids.extend(int(t) for t in prompt)  # type: ignore[arg-type]
    return request


def _sampling_proto(p: SamplingParams) -> generation_pb2.SamplingParameters:
    """Every field is sent, so the server's defaults never differ from the caller's."""
    sampling = generation_pb2.SamplingParameters(
        n=p.n,
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        top_n_sigma=p.top_n_sigma,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        stop_token_ids=list(p.stop_token_ids),
        stop=list(p.stop),
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
        logit_bias=dict(p.logit_bias),
    )
    if p.seed is not None:
        sampling.seed = p.seed
    return sampling


def _chunk(response: generation_pb2.GenerateResponse) -> StreamChunk:
    stop = response.WhichOneof("stop_reason")
    stop_reason: int | str | None = None
    if stop == "stop_token_id":
        stop_reason = response.stop_token_id
    elif stop == "stop_string":
        stop_reason = response.stop_string
    has_usage = response.HasField("usage")
    return StreamChunk(
        index=response.index,
        text=response.text,
        token_ids=list(response.token_ids),
        finish_reason=response.finish_reason or None,
        stop_reason=stop_reason,
        prompt_tokens=response.usage.prompt_tokens if has_usage else None,
        completion_tokens=response.usage.completion_tokens if has_usage else None,
        cached_tokens=response.usage.cached_tokens if has_usage else None,
    )


def _model_info(info: generation_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(info.model_name, info.max_model_len, info.vocab_size, list(info.eos_token_ids))


def _credentials(root_certificates: bytes | str | Path | None) -> grpc.ChannelCredentials | None:
    if root_certificates is None:
        return None
    pem = (
        root_certificates
        if isinstance(root_certificates, bytes)
        else Path(root_certificates).read_bytes()
    )
    return grpc.ssl_channel_credentials(root_certificates=pem)


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _error(exc: grpc.RpcError) -> ClientError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return ClientError(code.name if code is not None else "UNKNOWN", details or "")
