"""Which runner serves a checkpoint, from its architecture and vLLM's flags.

vLLM's semantics (docs "Pooling models"): ``--runner auto`` picks by the
architecture (an encoder pools, a ``*ForCausalLM`` generates);
``--runner pooling`` on a generation checkpoint converts it, by default to an
embedding model (``--convert embed``: last token, normalized); an explicit
``--convert embed|classify`` implies the pooling runner. ``hf_overrides``
naming ``classifier_from_token`` (Qwen3-Reranker) makes it a classifier.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvmesh.worker.models.bert import ENCODER_ARCHITECTURES

# hf_overrides keys this engine acts on; any other is refused by name.
_KNOWN_OVERRIDES = frozenset(
    {"architectures", "classifier_from_token", "method", "is_original_qwen3_reranker"}
)


@dataclass(frozen=True)
class RunnerChoice:
    """``runner``: "generate" or "pooling"; ``convert``: what a decoder becomes
    under the pooling runner ("embed" or "classify"; "none" for an encoder,
    which pools natively)."""

    runner: str
    convert: str
    hf_overrides: dict[str, Any]

    @property
    def pools_decoder(self) -> bool:
        return self.runner == "pooling" and self.convert != "none"


def parse_hf_overrides(raw: str) -> dict[str, Any]:
    """``--hf-overrides`` JSON (vLLM's flag), limited to the keys implemented."""
    if not raw:
        return {}
    try:
        overrides = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hf-overrides is not JSON: {exc}") from exc
    if not isinstance(overrides, dict):
        raise ValueError("--hf-overrides must be a JSON object")
    unknown = sorted(set(overrides) - _KNOWN_OVERRIDES)
    if unknown:
        raise ValueError(
            f"--hf-overrides keys {unknown} are not implemented; supported: "
            f"{sorted(_KNOWN_OVERRIDES)}"
        )
    return overrides


def choose_runner(
    architecture: str, runner: str = "auto", convert: str = "auto", hf_overrides: str = ""
) -> RunnerChoice:
    """The runner for a checkpoint of ``architecture``; ValueError for a
    combination that cannot be served, naming the flag."""
    overrides = parse_hf_overrides(hf_overrides)
    if architecture in ENCODER_ARCHITECTURES:
        if runner == "generate":
            raise ValueError(f"{architecture} is a pooling model (not --runner generate)")
        if overrides:
            raise ValueError(f"--hf-overrides is not implemented for {architecture}")
        if convert == "classify" and not architecture.endswith("ForSequenceClassification"):
            raise ValueError(f"{architecture} has no classification head (--convert classify)")
        return RunnerChoice("pooling", "none", {})
    wants_classifier = bool(overrides.get("classifier_from_token")) or any(
        str(a).endswith("ForSequenceClassification") for a in overrides.get("architectures", [])
    )
    if convert == "auto":
        if wants_classifier:
            convert = "classify"
        elif runner == "pooling":
            convert = "embed"  # vLLM: a *ForCausalLM under the pooling runner embeds
    if convert == "auto" or convert == "none":
        if runner == "pooling":
            raise ValueError(
                f"{architecture} is a generation model: --runner pooling needs --convert "
                "embed or classify"
            )
        if overrides:
            raise ValueError("--hf-overrides applies to a pooling conversion (--convert classify)")
        return RunnerChoice("generate", "none", {})
    if runner == "generate":
        raise ValueError(f"--convert {convert} needs the pooling runner, not --runner generate")
    if convert == "classify" and not overrides.get("classifier_from_token"):
        raise ValueError(
            "--convert classify of a generation model needs --hf-overrides with "
            "classifier_from_token (Qwen3-Reranker style); a trained score head "
            "(*ForSequenceClassification of a decoder) is not implemented"
        )
    if convert == "embed" and wants_classifier:
        raise ValueError("--hf-overrides names a classifier but --convert is embed")
    return RunnerChoice("pooling", convert, overrides)
