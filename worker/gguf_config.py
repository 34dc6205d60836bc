"""A GGUF file's metadata as the config.json of the checkpoint it was converted from.

llama.cpp's converter writes a model's facts as ``<arch>.<key>`` metadata
(``qwen3.block_count``, ``qwen3.attention.head_count_kv``, ...). The keys every
architecture shares are read here; each family's own (Gemma's soft-caps and
layer pattern, Granite's multipliers, the experts) come from its declaration's
``GGUFLayout`` (worker/models/<family>.py), as do the fields llama.cpp assumes
rather than stores. The result is a Hugging Face config.json dict, so a GGUF
file and the checkpoint it came from give the worker the same ModelConfig.

An architecture no family reads is refused by name with the supported list,
and so is any rotary setting the dict could not say (a partial rotary
dimension, a scaling type other than linear or YaRN).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

from kvmesh.services.runtime.model_prep import gguf_weights_file, resolve_model_path
from kvmesh.worker.models.config_checks import UnsupportedModelError
from kvmesh.worker.models.declaration import GGUFLayout
from kvmesh.worker.models.registry import gguf_model_class

# Tokenizer ids config.json carries (the vocabulary itself is the tokenizer's).
_TOKEN_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
# <arch>.<key> -> config.json field, for every architecture.
_COMMON_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "context_length": "max_position_embeddings",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "attention.sliding_window": "sliding_window",
}
_REQUIRED = ("block_count", "embedding_length", "attention.head_count")


def _value(field: ReaderField) -> Any:
    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.FLOAT32:
        # The converter stored config.json's decimal as float32: its shortest
        # float32 repr gives the decimal back (1e-06, not 9.99999997e-07).
        value = float(str(np.float32(value)))
    return value


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata value but the tokenizer's vocabulary arrays (large, and
    read by the tokenizer, not here)."""
    return {
        name: _value(field)
        for name, field in reader.fields.items()
        if not name.startswith("tokenizer.ggml.") or name in _TOKEN_IDS
    }


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(meta[f"{arch}.rope.scaling.factor"])
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(
                meta[f"{arch}.rope.scaling.original_context_length"]
            ),
        }
    raise UnsupportedModelError(
        f"GGUF {arch}.rope.scaling.type {kind!r} is not supported; supported: none, linear, yarn"
    )


def _frequency_factors(reader: GGUFReader, hf: dict[str, Any]) -> dict[str, Any] | None:
    """llama.cpp's ``rope_freqs`` tensor: per rotary pair, the divisor of its
    frequency. The converter writes Llama 3.x's ``llama3`` rope scaling only
    this way (no keys), so it is read as what it is, fixed per-pair divisors:
    LongRoPE's form with one factor list and no length switch or attention
    factor (the same tables; float32 rounding of the divisors aside)."""
    found = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    if not found:
        return None
    if "rope_scaling" in hf:
        raise UnsupportedModelError(
            f"GGUF with both rope_freqs and rope.scaling.type {hf['rope_scaling']['rope_type']!r} "
            "is not supported; supported: one of them"
        )
    factors = [float(f) for f in np.asarray(found[0].data, dtype=np.float32)]
    if len(factors) != int(hf["head_dim"]) // 2:
        raise ValueError(f"rope_freqs has {len(factors)} factors, not head_dim / 2")
    return {
        "rope_type": "longrope",
        "short_factor": factors,
        "long_factor": factors,
        "original_max_position_embeddings": int(hf["max_position_embeddings"]),
        "attention_factor": 1.0,
    }


def gguf_hf_config(path: Path) -> dict[str, Any]:
    """The config.json dict of the checkpoint ``path`` (a .gguf file) was converted from."""
    reader = GGUFReader(str(path))
    meta = read_metadata(reader)
    arch = str(meta["general.architecture"])
    model_class = gguf_model_class(arch, bool(meta.get(f"{arch}.expert_count")))
    layout: GGUFLayout | None = model_class.declaration.gguf
    assert layout is not None
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    missing = [k for k in _REQUIRED if f"{arch}.{k}" not in meta]
    if missing or "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: not a complete {arch} GGUF (missing {missing or 'token_embd'})")
    hf: dict[str, Any] = {
        "architectures": [layout.hf_architecture],
        "model_type": layout.model_type,
        "torch_dtype": "float32",  # dense tensors load as float32; blocks stay blocks
        "vocab_size": shapes["token_embd.weight"][0],
        # llama.cpp ties the head to the embedding when the file has no output.weight.
        "tie_word_embeddings": "output.weight" not in shapes,
        **dict(layout.config_fixed),
    }
    for key, field in {**_COMMON_KEYS, **layout.config_keys}.items():
        if f"{arch}.{key}" in meta:
            hf[field] = meta[f"{arch}.{key}"]
    for key, field in _TOKEN_IDS.items():
        hf[field] = meta.get(key)
    heads = int(hf["num_attention_heads"])
    hf.setdefault("num_key_value_heads", heads)
    hf.setdefault("head_dim", int(hf["hidden_size"]) // heads)
    hf.setdefault("rope_theta", 10_000.0)
    rope_dims = meta.get(f"{arch}.rope.dimension_count", hf["head_dim"])
    if int(rope_dims) != int(hf["head_dim"]):
        raise UnsupportedModelError(
            f"GGUF {arch}.rope.dimension_count {rope_dims} (a partial rotary) is not "
            f"supported; supported: the head dim ({hf['head_dim']})"
        )
    scaling = _rope_scaling(meta, arch)
    if scaling is not None:
        hf["rope_scaling"] = scaling
    factors = _frequency_factors(reader, hf)
    if factors is not None:
        hf["rope_scaling"] = factors
    if layout.config_hook is not None:
        layout.config_hook(meta, shapes, hf)
    return hf


def write_gguf_config(gguf_path: Path, out_dir: Path) -> None:
    """``out_dir/config.json``: the checkpoint config ``gguf_path``'s metadata stands
    for (atomic: services starting together may both write it, with the same bytes).
    An architecture no family reads is refused here, by name with the supported list."""
    hf_config = gguf_hf_config(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f"config.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(hf_config, indent=2) + "\n")
    tmp.replace(out_dir / "config.json")


def ensure_gguf_config(folder: Path) -> Path:
    """``folder`` (from resolve_model_path) with its config.json written if it stands
    for a GGUF file; a checkpoint folder is returned as it is."""
    gguf_file = gguf_weights_file(folder)
    if gguf_file is not None and not (folder / "config.json").is_file():
        write_gguf_config(gguf_file, folder)
    return folder


def prepare_model_folder(model: str) -> Path:
    """The folder a worker (or the in-process engine) loads ``model`` from: the
    services' resolution (a folder, a GGUF file's tokenizer folder, or the prepared
    default) plus a GGUF file's config.json, which only the worker can write."""
    return ensure_gguf_config(resolve_model_path(model))
