"""Turn a step's packed hidden states into one vector per sequence.

The recipe comes from the checkpoint: a sentence-transformers folder names its
modules in ``modules.json`` (Transformer, Pooling, Dense, Normalize), and the
pipeline after the transformer is replayed here in the same order; without
one, the defaults are vLLM's (CLS for BERT-family encoders, last token for
decoders, normalized). ``*ForSequenceClassification`` checkpoints are scored
by their head (worker/models/bert.py), not pooled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

POOLING_TYPES = ("cls", "mean", "last", "max")

# sentence-transformers' pooling_mode_* flags (its pre-6 config) to our names.
_LEGACY_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
}
_DENSE_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": torch.tanh,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.ReLU": F.relu,
    "torch.nn.modules.activation.GELU": F.gelu,
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
}


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module: ``activation(x @ W.T + b)``."""

    weight: torch.Tensor = field(repr=False)
    bias: torch.Tensor | None = field(repr=False)
    activation: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(
            x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )
        return _DENSE_ACTIVATIONS[self.activation](y)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


@dataclass(frozen=True)
class PoolerSpec:
    """How a model's token states become a sentence embedding."""

    pooling_type: str
    normalize: bool
    dense: tuple[DenseLayer, ...] = ()
    # The sentence-transformers max_seq_length (0: the model's own maximum).
    max_seq_length: int = 0
    # Matryoshka: dimensions the model was trained to be cut to (empty: any cut is refused).
    matryoshka_dimensions: tuple[int, ...] = ()
    # sentence-transformers' include_prompt=False is not implemented: refused at load.

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling type {self.pooling_type!r} is not implemented; supported: {POOLING_TYPES}"
            )

    def output_dim(self, hidden_size: int) -> int:
        return self.dense[-1].out_features if self.dense else hidden_size

    def pool(self, hidden: torch.Tensor, seq_lens: tuple[int, ...] | list[int]) -> torch.Tensor:
        """``[num_tokens, hidden]`` packed states -> ``[num_seqs, dim]`` (before any cut)."""
        pooled = []
        start = 0
        for n in seq_lens:
            states = hidden[start : start + n]
            start += n
            if self.pooling_type == "cls":
                pooled.append(states[0])
            elif self.pooling_type == "last":
                pooled.append(states[-1])
            elif self.pooling_type == "max":
                pooled.append(states.max(dim=0).values)
            else:
                pooled.append(states.mean(dim=0))
        out = torch.stack(pooled)
        for layer in self.dense:
            out = layer(out)
        return out

    @classmethod
    def default_for(cls, is_encoder: bool) -> PoolerSpec:
        return cls(pooling_type="cls" if is_encoder else "last", normalize=True)

    @classmethod
    def from_folder(cls, folder: str | Path, is_encoder: bool) -> PoolerSpec:
        """The folder's sentence-transformers pipeline, or the default without one."""
        folder = Path(folder)
        matryoshka = _matryoshka_dimensions(folder)
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            spec = cls.default_for(is_encoder)
            return cls(spec.pooling_type, spec.normalize, matryoshka_dimensions=matryoshka)
        pooling_type = "cls" if is_encoder else "last"
        normalize = False
        dense: list[DenseLayer] = []
        for module in json.loads(modules_file.read_text()):
            kind = str(module["type"]).rsplit(".", 1)[-1]
            path = folder / module.get("path", "")
            if kind == "Transformer":
                continue
            if kind == "Pooling":
                pooling_type = _pooling_type(json.loads((path / "config.json").read_text()))
            elif kind == "Dense":
                dense.append(_dense_layer(path))
            elif kind == "Normalize":
                normalize = True
            else:
                raise ValueError(f"sentence-transformers module {kind!r} is not implemented")
        return cls(
            pooling_type=pooling_type,
            normalize=normalize,
            dense=tuple(dense),
            max_seq_length=_max_seq_length(folder),
            matryoshka_dimensions=matryoshka,
        )


def _pooling_type(config: dict[str, Any]) -> str:
    if config.get("include_prompt") is False:
        raise ValueError(
            "sentence-transformers Pooling with include_prompt=false is not implemented"
        )
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        modes = [mode]
    elif isinstance(mode, list):
        modes = [str(m) for m in mode]
    else:
        modes = [ours for key, ours in _LEGACY_MODES.items() if config.get(key)]
        other = [
            k
            for k, v in config.items()
            if k.startswith("pooling_mode_") and v and k not in _LEGACY_MODES
        ]
        if other:
            raise ValueError(f"sentence-transformers pooling {other} is not implemented")
    names = {"cls_token": "cls", "mean_tokens": "mean", "lasttoken": "last", "max_tokens": "max"}
    modes = [names.get(m, m) for m in modes]
    if len(modes) != 1:
        raise ValueError(f"pooling over several modes at once ({modes}) is not implemented")
    return modes[0]


def _dense_layer(path: Path) -> DenseLayer:
    config = json.loads((path / "config.json").read_text())
    activation = str(config.get("activation_function", "torch.nn.modules.linear.Identity"))
    if activation not in _DENSE_ACTIVATIONS:
        raise ValueError(f"Dense activation {activation!r} is not implemented")
    weights = load_file(str(path / "model.safetensors"))
    return DenseLayer(
        weight=weights["linear.weight"].float(),
        bias=weights["linear.bias"].float() if "linear.bias" in weights else None,
        activation=activation,
    )


def _max_seq_length(folder: Path) -> int:
    config_file = folder / "sentence_bert_config.json"
    if not config_file.is_file():
        return 0
    return int(json.loads(config_file.read_text()).get("max_seq_length") or 0)


def _matryoshka_dimensions(folder: Path) -> tuple[int, ...]:
    """Dimensions a Matryoshka model may be cut to, as vLLM reads them from config.json
    (``matryoshka_dimensions``; ``is_matryoshka: true`` allows any cut)."""
    config = json.loads((folder / "config.json").read_text())
    dims = config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    if config.get("is_matryoshka"):
        return (-1,)  # any dimension up to the output size
    return ()


def finish_embedding(
    pooled: torch.Tensor, spec: PoolerSpec, normalize: bool | None, dimensions: int | None
) -> torch.Tensor:
    """One request's vector: Matryoshka cut first, then normalization (as
    sentence-transformers' truncate_dim + Normalize and vLLM do)."""
    if dimensions:
        pooled = pooled[..., :dimensions]
    if spec.normalize if normalize is None else normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled
