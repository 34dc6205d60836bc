"""``kvmesh.LLM``: offline batched generation in this process, as ``vllm.LLM``.

The same engine the stack runs, without its services: the real Scheduler
drives a ModelRunner step by step (``kvmesh.engine.InProcessEngine``), every
prompt of a call batched together (continuous batching, paged KV cache, prefix
caching, preemption as served). The gateway's jobs happen here in the caller's
thread: the model's chat template, tokenization, the context-length check; the
detokenizer's too: incremental text and stop strings, a stop string ending its
request in the scheduler as the detokenizer service asks it to.

    llm = kvmesh.LLM()  # the prepared default model (`make install`)
    outputs = llm.generate(["The capital of France is"], kvmesh.SamplingParams(temperature=0))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvmesh.detokenizer.incremental import IncrementalDetokenizer
from kvmesh.detokenizer.tokenizer_loader import load_tokenizer
from kvmesh.engine import GenerationResult, InProcessEngine
from kvmesh.gateway.tokenizer import Tokenizer
from kvmesh.llm_pooling import PoolingMethods, build_pooling_engine
from kvmesh.outputs import CompletionOutput, RequestOutput
from kvmesh.pooling_engine import PoolingEngine
from kvmesh.sampling_params import SamplingParams, as_list
from kvmesh.services.contracts.finish_reason import FinishReason
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.gguf_config import prepare_model_folder
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.registry import check_model
from kvmesh.worker.pooling_runner import checkpoint_architecture
from kvmesh.worker.runner_choice import choose_runner
from kvmesh.worker.step_budget import preferred_step_tokens

logger = logging.getLogger(__name__)

# The worker service's default KV budget (--kv-cache-memory).
DEFAULT_KV_CACHE_MEMORY = 1 << 30

Prompt = str | Sequence[int]
Message = Mapping[str, Any]


class LLM(PoolingMethods):
    """A model loaded in this process, generating for batches of prompts, or
    pooling them (``embed``/``score``/``classify``, kvmesh/llm_pooling.py).

    ``model``: a Hugging Face checkpoint folder or a ``.gguf`` file (None: the
    prepared default, SmolLM2-135M-Instruct). ``dtype``: "auto" (by the
    hardware, as ``kvmesh serve worker``), "float32" or "bfloat16". The KV
    cache holds ``num_kv_blocks`` blocks of ``block_size`` tokens, or as many as
    ``kv_cache_memory_bytes`` holds; ``kv_cache_dtype``: vLLM's --kv-cache-dtype
    (auto, int8, fp8 / fp8_e4m3, fp8_e5m2: kernels/kv_quant.py).
    ``max_num_batched_tokens`` None takes the step budget the worker would ask
    for on this hardware. Loading takes the process's torch threads
    (``num_threads``, None: one per CPU).

    ``runner``/``convert``/``hf_overrides``: vLLM's (worker/runner_choice.py):
    an encoder checkpoint pools by itself; ``runner="pooling"`` serves a
    generation checkpoint as an embedding model (last token, normalized),
    ``hf_overrides={"classifier_from_token": ["no", "yes"]}`` as a yes/no reranker.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        quantization: str | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 128,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        num_threads: int | None = None,
        runner: str = "auto",
        convert: str = "auto",
        hf_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        folder = prepare_model_folder(str(model) if model is not None else "")
        choice = choose_runner(
            checkpoint_architecture(folder),
            runner,
            convert,
            json.dumps(dict(hf_overrides)) if hf_overrides else "",
        )
        self._pooling: PoolingEngine | None = None
        self._ids = itertools.count()
        if choice.runner == "pooling":
            if kv_cache_dtype != "auto":
                raise ValueError(
                    f"kv_cache_dtype={kv_cache_dtype!r} is for generation: a pooling model "
                    "keeps no KV cache between steps"
                )
            self._pooling = build_pooling_engine(
                Path(folder),
                choice,
                dtype=dtype,
                quantization=quantization,
                max_model_len=max_model_len,
                num_threads=num_threads,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens
                or preferred_step_tokens("cpu", self._pooling_dtype(folder, dtype)),
            )
            self.tokenizer = Tokenizer.from_pretrained(folder)
            logger.info(
                "LLM ready (pooling: %s): %s, max_model_len %d",
                ",".join(self._pooling.runner.info.tasks),
                folder,
                self._pooling.max_model_len,
            )
            return
        model_config = ModelConfig.from_pretrained(
            model if model is not None else folder,
            dtype=dtype,
            max_model_len=max_model_len,
            quantization=quantization,
        )
        # Refuse an unknown architecture or config feature before anything is allocated.
        check_model(model_config)
        cache_config = CacheConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=None if num_kv_blocks else kv_cache_memory_bytes,
            kv_cache_dtype=kv_cache_dtype,
        )
        runner = ModelRunner(model_config, cache_config, num_threads=num_threads)
        budget = max_num_batched_tokens or preferred_step_tokens("cpu", model_config.dtype)
        self.engine = InProcessEngine(
            runner,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.tokenizer = Tokenizer.from_pretrained(folder)
        # The detokenizer service's own tokenizer (tokenizer.json), so text
        # comes out exactly as the stack streams it.
        self._detokenizer_tokenizer = load_tokenizer(folder)
        self.model_config = model_config
        logger.info(
            "LLM ready: %s, dtype %s, %d KV blocks, max_model_len %d",
            folder,
            str(model_config.dtype).removeprefix("torch."),
            runner.num_kv_blocks,
            self.max_model_len,
        )

    @staticmethod
    def _pooling_dtype(folder: str | Path, dtype: str) -> torch.dtype:
        """The compute dtype ``dtype`` resolves to (what the step budget depends on)."""
        return ModelConfig.from_pretrained(folder, dtype=dtype).dtype

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output in tokens (the model's, capped by the KV cache);
        for a pooling model, the longest input (capped by the step budget)."""
        if self._pooling is not None:
            return self._pooling.max_model_len
        return self.engine.scheduler.config.max_model_len

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids) together; one output per
        prompt, in order. ``sampling_params``: one for all, or one per prompt.

        Raises ``ValueError`` for an empty prompt, a token id outside the
        vocabulary, or a prompt + ``max_tokens`` longer than ``max_model_len``.
        """
        batch = _as_prompt_list(prompts)
        encoded = [
            (p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, [int(t) for t in p])
            for p in batch
        ]
        return self._run(encoded, as_list(sampling_params, len(batch)))

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of ``{"role", "content"}``
        messages) or to each of a list of them, rendered with the model's own chat
        template as ``/v1/chat/completions`` renders it.

        Raises ``ValueError`` (``kvmesh.gateway.tokenizer.ChatTemplateError``) where the
        template rejects a conversation or the model has none.
        """
        conversations = _as_conversation_list(messages)
        encoded = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in conversation],
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **dict(chat_template_kwargs or {}),
            )
            # The template writes the special tokens (BOS) itself.
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(encoded, as_list(sampling_params, len(conversations)))

    def _run(
        self, prompts: list[tuple[str | None, list[int]]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        if self._pooling is not None:
            raise ValueError(
                "this LLM serves a pooling model: use embed/score/classify, not generation"
            )
        for (_, token_ids), p in zip(prompts, params, strict=True):
            self._check_prompt(token_ids, p)
        batch = next(self._ids)
        streams: dict[str, _SampleStream] = {}
        for i, ((_, token_ids), p) in enumerate(zip(prompts, params, strict=True)):
            engine_params = p.engine_params()
            for sample in range(p.n):
                request_id = f"{batch}-{i}-{sample}"
                streams[request_id] = _SampleStream(
                    IncrementalDetokenizer(
                        self._detokenizer_tokenizer, token_ids, p.detokenize_params()
                    )
                )
                # Samples of one prompt share it: computed once, as the server does.
                group = f"{batch}-{i}" if p.n > 1 else None
                self.engine.add_request(request_id, token_ids, engine_params, parallel_group=group)
        try:
            self._step_until_done(streams)
        finally:
            # A failure mid-batch (a worker error raised, KeyboardInterrupt)
            # leaves no request behind to run in the next call.
            self.engine.scheduler.abort_requests(list(streams))
        outputs = []
        for i, ((text, token_ids), p) in enumerate(zip(prompts, params, strict=True)):
            samples = [
                streams[f"{batch}-{i}-{sample}"].output(
                    sample, self.engine.results.pop(f"{batch}-{i}-{sample}")
                )
                for sample in range(p.n)
            ]
            outputs.append(RequestOutput(f"{batch}-{i}", text, token_ids, samples))
        return outputs

    def _step_until_done(self, streams: dict[str, _SampleStream]) -> None:
        while self.engine.has_unfinished_requests():
            for out in self.engine.step_outputs():
                stream = streams[out.request_id]
                stop_string = stream.update(
                    out.new_token_ids,
                    finished=out.finished,
                    stopped_by_token=out.finish_reason is FinishReason.STOP,
                )
                if stop_string is not None and not out.finished:
                    self.engine.finish_stopped(out.request_id)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("a prompt must have at least one token")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(token_ids)} and max_tokens is {params.max_tokens}"
            )


class _SampleStream:
    """One sample's text as the detokenizer service builds it."""

    def __init__(self, detokenizer: IncrementalDetokenizer) -> None:
        self.detokenizer = detokenizer
        self.text: list[str] = []
        self.stop_string: str | None = None

    def update(
        self, new_token_ids: list[int], *, finished: bool, stopped_by_token: bool
    ) -> str | None:
        """Add a step's tokens; returns the stop string that ended the text, if one did now."""
        if self.detokenizer.finished:
            return None
        delta = self.detokenizer.update(
            list(new_token_ids), finished, stopped_by_token=stopped_by_token
        )
        self.text.append(delta.text)
        if delta.stop_string is not None:
            self.stop_string = delta.stop_string
        return delta.stop_string

    def output(self, index: int, result: GenerationResult) -> CompletionOutput:
        # A stop string decides the reason even when the same step hit max_tokens.
        if self.stop_string is not None:
            return CompletionOutput(
                index, "".join(self.text), result.output_token_ids, "stop", self.stop_string
            )
        return CompletionOutput(
            index,
            "".join(self.text),
            result.output_token_ids,
            result.finish_reason,
            result.stop_reason,
        )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A single prompt (text, or a list of ids) or a list of them -> a list."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt as token ids
    return prompts


def _as_conversation_list(
    messages: Sequence[Message] | Sequence[Sequence[Message]],
) -> list[Sequence[Message]]:
    messages = list(messages)
    if messages and isinstance(messages[0], Mapping):
        return [messages]  # one conversation
    return messages  # type: ignore[return-value]
