"""GGUF files of a float checkpoint in llama.cpp's usual mixes, written once and cached.

``write_mix(checkpoint, "Q4_K_M")`` writes what ``llama-quantize`` would name
Q4_K_M, Q5_K_M, Q6_K or Q8_0, with the ``gguf`` package's writer and the
quantizer of kernels/ggml_quantize.py, choosing each tensor's type by
llama.cpp's rules (``llama_tensor_get_type``, the parts that apply to a
Llama):

* Q4_K_M: Q4_K, but Q6_K for attn_v and ffn_down in the layers
  ``use_more_bits`` picks (the first and last eighth, every third between);
  Q5_K_M: the same with Q5_K; Q6_K, Q8_0: every projection in that type;
* the LM head (or a tied embedding, which is the head) Q6_K, except in Q8_0;
* a row whose width is no multiple of 256 cannot hold K-quant super-blocks:
  llama.cpp falls back to Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (SmolLM2's
  576-wide rows: every projection but ffn_down);
* norms F32; q and k rows permuted as convert_hf_to_gguf.py does.

The folder next to each file names it (services/runtime/model_prep.GGUF_MARKER) and
holds the checkpoint's config and tokenizer, so kvmesh serves it like any
GGUF; ``reference`` is a float32 checkpoint of exactly the weights the
``gguf`` package dequantizes from the file (the accuracy oracle). Files live in
the model cache (``MODEL_CACHE/kquant/<checkpoint>-<mix>``) and are reused.

    python -m tests.worker.kquant_files [--mix Q4_K_M ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from kvmesh.kernels.ggml_quantize import quantize
from kvmesh.services.runtime.config.process import MODEL_CACHE
from kvmesh.services.runtime.model_prep import GGUF_MARKER, default_model_path
from kvmesh.worker.models.llama import LLAMA_GGUF

Q = GGMLQuantizationType
MIXES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
# llama.cpp's fallback when a row is no whole number of 256-weight super-blocks.
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
_VERSION = "1"  # bump when the writer or quantizer changes: a new cache folder


@dataclass(frozen=True)
class MixFiles:
    folder: Path  # names the GGUF (serve or load this)
    gguf: Path
    reference: Path | None  # float32 checkpoint of the dequantized weights


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(mix: str, part: str, layer: int, layers: int, cols: int) -> GGMLQuantizationType:
    """The type of one projection (``part``: a GGUF name part, or "output")."""
    if mix == "Q8_0":
        return Q.Q8_0
    base = {"Q4_K_M": Q.Q4_K, "Q5_K_M": Q.Q5_K, "Q6_K": Q.Q6_K}[mix]
    if part == "output" or (part in ("attn_v", "ffn_down") and use_more_bits(layer, layers)):
        kind = Q.Q6_K
    else:
        kind = base
    return _FALLBACK[kind] if cols % 256 else kind


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row permutation (interleaved rotary halves)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(2, 1)
        .reshape(weight.shape)
    )


def write_mix(
    checkpoint: Path, mix: str, cache: Path | None = None, with_reference: bool = True
) -> MixFiles:
    """The cached GGUF (and reference) of ``checkpoint`` in ``mix``; written if missing."""
    from safetensors.torch import load_file, save_file

    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; expected one of {MIXES}")
    root = (cache or MODEL_CACHE.get() / "kquant") / f"{checkpoint.name}-{mix}-v{_VERSION}"
    files = MixFiles(root / "named", root / f"{checkpoint.name}-{mix}.gguf", root / "reference")
    done = root / "done"
    if done.is_file() and (not with_reference or (root / "reference" / "done").is_file()):
        return files
    root.mkdir(parents=True, exist_ok=True)
    config = json.loads((checkpoint / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    layers = config["num_hidden_layers"]
    state = load_file(str(checkpoint / "model.safetensors"))
    tied = "lm_head.weight" not in state
    writer = GGUFWriter(files.gguf, "llama")
    reference: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str, kind: GGMLQuantizationType, permute: int = 0) -> None:
        weight = state[hf_name].float().numpy()
        if permute:
            weight = _permute(weight, permute)
        if kind == Q.F32:
            writer.add_tensor(gguf_name, weight)
            back = weight
        else:
            data = quantize(weight, kind)
            writer.add_tensor(gguf_name, data, raw_dtype=kind)
            back = dequantize(data, kind).reshape(weight.shape)
        if permute:
            back = _unpermute(back, permute)
        if with_reference:
            reference[hf_name] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))

    hidden = config["hidden_size"]
    head_kind = tensor_type(mix, "output", 0, layers, hidden)
    embed_kind = head_kind if tied else tensor_type(mix, "token_embd", 0, layers, hidden)
    add("token_embd.weight", "model.embed_tokens.weight", embed_kind)
    add("output_norm.weight", "model.norm.weight", Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", head_kind)
    for layer in range(layers):
        for part, hf_part in LLAMA_GGUF.layer_names.items():
            name = f"model.layers.{layer}.{hf_part}.weight"
            cols = state[name].shape[-1]
            kind = Q.F32 if state[name].dim() == 1 else tensor_type(mix, part, layer, layers, cols)
            permute = {"attn_q": heads, "attn_k": kv_heads}.get(part, 0)
            add(f"blk.{layer}.{part}.weight", name, kind, permute)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    files.folder.mkdir(exist_ok=True)
    for name in _COPIED:
        if (checkpoint / name).is_file():
            shutil.copy(checkpoint / name, files.folder / name)
    (files.folder / GGUF_MARKER).write_text(json.dumps({"gguf_file": str(files.gguf)}) + "\n")
    if with_reference:
        ref = root / "reference"
        ref.mkdir(exist_ok=True)
        for name in _COPIED:
            if (checkpoint / name).is_file():
                shutil.copy(checkpoint / name, ref / name)
        save_file(reference, str(ref / "model.safetensors"))
        (ref / "done").write_text("")
    done.write_text("")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--mix", action="append", choices=MIXES)
    args = parser.parse_args(argv)
    for mix in args.mix or MIXES:
        start = time.perf_counter()
        files = write_mix(args.model, mix)
        size = files.gguf.stat().st_size
        print(f"{mix}: {files.gguf} ({size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
