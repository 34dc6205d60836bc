"""A PEFT LoRA adapter folder: its files, its config and its content id.

The gateway reads these when an adapter is registered (``--lora-modules`` or
``POST /v1/load_lora_adapter``) to refuse a folder that could never load and to
name the adapter by content (``LoRARequest.lora_id``); the worker reads the
same config when it loads the weights into a slot.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's "every linear layer": which ones is the model family's declaration
# (worker/models/declaration.py), read by the worker when it loads the adapter.
ALL_LINEAR = "all-linear"
# A PEFT module name: which names a model has is its family's declaration, checked
# by the worker at load (this module is the gateway's too, and knows no model).
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class AdapterConfig:
    """What serving an adapter needs from its adapter_config.json."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """PEFT's multiplier of B·A: alpha/r, or alpha/sqrt(r) with rsLoRA."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)


def _target_modules(value: Any) -> tuple[str, ...]:
    if value == ALL_LINEAR:
        return (ALL_LINEAR,)
    # PEFT matches a listed name as a suffix of the module path (and saves
    # "all-linear" as full paths); which layers an adapter changes is what its
    # weights file holds. A regex in a plain string is not served.
    names = [value] if isinstance(value, str) else list(value or [])
    names = sorted({str(n).rsplit(".", 1)[-1] for n in names})
    unsupported = [n for n in names if not _MODULE_NAME.fullmatch(n)]
    if unsupported or not names:
        raise ValueError(
            f"target_modules {unsupported or names} not supported; an adapter may target "
            "the model's projections by their PEFT names (q_proj, ..., or all-linear)"
        )
    return tuple(names)


def read_adapter_config(folder: str | Path) -> AdapterConfig:
    """The adapter's config; ValueError if the folder is not a LoRA adapter kvmesh serves."""
    folder = Path(folder)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (folder / name).is_file():
            raise ValueError(f"no {name} in {folder}")
    try:
        raw: dict[str, Any] = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable {ADAPTER_CONFIG} in {folder}: {exc}") from exc
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type {raw.get('peft_type')!r} is not LORA")
    # Variants whose forward is not y + scaling * B(A(x)) are refused, not approximated.
    refused = {
        "use_dora": bool(raw.get("use_dora")),
        "fan_in_fan_out": bool(raw.get("fan_in_fan_out")),
        "bias": raw.get("bias", "none") != "none",
        "modules_to_save": bool(raw.get("modules_to_save")),
        "rank_pattern": bool(raw.get("rank_pattern")),
        "alpha_pattern": bool(raw.get("alpha_pattern")),
        "layers_to_transform": raw.get("layers_to_transform") is not None,
    }
    if any(refused.values()):
        raise ValueError(f"unsupported adapter options: {[k for k, v in refused.items() if v]}")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"r must be a positive integer, got {rank!r}")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise ValueError(f"lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(
        rank=rank,
        alpha=float(alpha),
        target_modules=_target_modules(raw.get("target_modules")),
        use_rslora=bool(raw.get("use_rslora", False)),
    )


def adapter_id(folder: str | Path) -> str:
    """Hex SHA-256 over the config and the weights (LoRARequest.lora_id).

    Each file is length-prefixed so that bytes cannot move from one to the other.
    """
    digest = hashlib.sha256(b"kvmesh.lora.v1")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        path = Path(folder) / name
        digest.update(path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as file:
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
