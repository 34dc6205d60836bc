"""``kvmesh.SamplingParams``: how a Python caller asks for text, as ``vllm.SamplingParams``.

One frozen object covers both halves the services split between them: the
token-level fields the scheduler and sampler read (``kvmesh.services.contracts.sampling_params``)
and the text-level ones the detokenizer reads (stop strings, special tokens).
It is validated when built, so a bad value fails at the caller's line, not
inside the engine. ``kvmesh.LLM`` hands it to the engine in process;
``kvmesh.Client`` sends the same fields over the public gRPC API.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.services.contracts.sampling_params import TOP_N_SIGMA_MAX, DetokenizeParams
from kvmesh.services.contracts.sampling_params import SamplingParams as EngineSamplingParams

# The gateway's limit for `n` (OpenAI's 128).
MAX_N = 128


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping for one prompt; the defaults are vLLM's.

    ``temperature=0`` is greedy. ``stop`` ends the text at the first of these
    strings (left out of the text unless ``include_stop_str_in_output``);
    ``stop_token_ids`` and the model's EOS ids end it at a token. ``n`` asks
    for that many samples of the prompt.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    # Top-n-sigma (llama.cpp's top_n_sigma): keep tokens whose logit is at least
    # the top logit minus this many standard deviations of the logits; 0: off.
    top_n_sigma: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # token id -> additive bias on its logit (OpenAI's logit_bias).
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # Accept what a caller naturally writes (a str, a list) and keep tuples,
        # so the object stays immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(
            self, "logit_bias", {int(k): float(v) for k, v in dict(self.logit_bias).items()}
        )
        _check(1 <= self.n <= MAX_N, f"n must be in 1..{MAX_N}, got {self.n}")
        _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            0 <= self.top_n_sigma <= TOP_N_SIGMA_MAX,
            f"top_n_sigma must be in [0, {TOP_N_SIGMA_MAX:g}], got {self.top_n_sigma}",
        )
        _check(
            -2 <= self.presence_penalty <= 2,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.repetition_penalty > 0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in 0..max_tokens, got {self.min_tokens}",
        )
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0")

    def engine_params(self) -> EngineSamplingParams:
        """The token-level half, as the scheduler and the worker's sampler read it."""
        return EngineSamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            top_n_sigma=self.top_n_sigma,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            logit_bias=tuple(sorted(self.logit_bias.items())),
        )

    def detokenize_params(self) -> DetokenizeParams:
        """The text-level half, as the detokenizer reads it."""
        return DetokenizeParams(
            stop=self.stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def as_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One params object per prompt: ``None`` is the defaults, one object is shared,
    a sequence must match the prompts one to one."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return params
