"""Per-request generation parameters shared by every service.

The gateway validates user input and builds these; the scheduler reads the
stopping fields; the worker's sampler reads the sampling fields; the
detokenizer reads the text fields. They travel on the wire as
``kvmesh.internal.v1.SamplingParams`` (see ``services/contracts/step_codec.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvmesh.services.contracts.pooling_params import PoolingParams

# Below this temperature sampling is greedy (vLLM uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5
# The largest top_n_sigma accepted: past it every finite logit is kept anyway, and it
# must stay finite as the float32 it travels as.
TOP_N_SIGMA_MAX = 1e4


StructuredOutputKind = Literal["json", "json_object", "regex", "choice", "grammar"]
STRUCTURED_OUTPUT_KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """A constraint on the generated text, compiled by the worker into a token grammar.

    ``value`` by kind: "json" a JSON schema (serialized), "json_object" unused
    (any JSON object), "regex" a regular expression, "choice" a JSON array of
    the allowed strings, "grammar" an EBNF grammar whose root rule is ``root``.
    Hashable, so the worker's compile cache is keyed by the spec itself.
    """

    kind: StructuredOutputKind
    value: str = ""
    # The end of the model's thinking, as token ids (a reasoning parser's end
    # tag): when set, the constraint applies only to the tokens generated
    # after the first occurrence of this sequence, as vLLM applies structured
    # output once reasoning ended. Empty: from the first token.
    reasoning_end_token_ids: tuple[int, ...] = ()

    @property
    def grammar(self) -> StructuredOutputSpec:
        """The same constraint without the reasoning gate: what the worker compiles."""
        return StructuredOutputSpec(self.kind, self.value)


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled and when it stops (token level)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    # Top-n-sigma (llama.cpp's top_n_sigma): keep the tokens whose logit is at least
    # max - top_n_sigma * std over the finite logits. 0 disables it.
    top_n_sigma: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # token id -> additive bias, as OpenAI's logit_bias.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: no logprobs; k >= 0: sampled token's logprob plus the top k.
    logprobs: int | None = None
    # None: unconstrained. Otherwise every sampled token keeps the text a
    # prefix of the spec's language, and EOS is forced when it is complete.
    structured_output: StructuredOutputSpec | None = None
    # None: no prompt logprobs; k >= 0: each prompt token's logprob (from the
    # second on) plus the top k, computed during prefill. Such a request
    # computes its whole prompt (no prefix-cache hits: cached positions have
    # no logits).
    prompt_logprobs: int | None = None
    # vLLM's allowed_token_ids: only these may be sampled (empty: any token).
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words as token sequences: a sequence's last token is banned
    # where the output ends with the rest of it (one-token words always).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Set: a pooling request (no tokens generated; services/contracts/pooling_params.py).
    pooling: PoolingParams | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class DetokenizeParams:
    """How generated token ids become text (detokenizer only)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    extra: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
