"""What ``kvmesh.LLM`` and ``kvmesh.Client`` return: vLLM's output shapes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of one prompt."""

    # Which of the prompt's `n` samples this is.
    index: int
    text: str
    token_ids: list[int]
    # "stop" (EOS, a stop token or a stop string), "length" (max_tokens or the
    # context), "abort" or "error".
    finish_reason: str | None
    # What stopped it when finish_reason is "stop": the stop_token_ids entry or
    # the stop string; None for the model's EOS.
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """A prompt and its samples, in the order of ``index``."""

    request_id: str
    # The prompt's text (None where the prompt was given as token ids).
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)
