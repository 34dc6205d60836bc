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


@dataclass(frozen=True)
class EmbeddingOutput:
    """One input's embedding (``LLM.embed``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class ScoringOutput:
    """One pair's score (``LLM.score``): a cross-encoder's or a yes/no
    reranker's probability, or a bi-encoder's cosine similarity."""

    score: float


@dataclass(frozen=True)
class ClassificationOutput:
    """One input's class probabilities (``LLM.classify``): softmax over the
    labels, or the one label's sigmoid."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True)
class PoolingRequestOutput:
    """An input of ``LLM.embed``/``score``/``classify`` and its result, as
    vLLM's ``EmbeddingRequestOutput``/``ScoringRequestOutput``/``ClassificationRequestOutput``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput | ClassificationOutput
    finished: bool = True
