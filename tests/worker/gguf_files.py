"""Tiny GGUF files written the way llama.cpp's converter writes them, for loader tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from kvmesh.services.runtime.model_prep import GGUF_MARKER
from kvmesh.worker.models.registry import get_model_class

Q8_0, Q4_0, Q4_1, F32, F16 = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
)
# One of each block type among a layer's projections; the embedding in Q8_0 like
# the default model's; norms in F32.
LAYER_TYPES = {
    "attn_q": Q8_0,
    "attn_k": Q4_0,
    "attn_v": Q4_1,
    "attn_output": Q4_0,
    "ffn_gate": Q4_1,
    "ffn_up": Q8_0,
    "ffn_down": Q4_1,
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row permutation (interleaved rotary halves)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(
    checkpoint: Path, out_dir: Path, embedding_type: GGMLQuantizationType = Q8_0
) -> tuple[Path, Path]:
    """A GGUF of ``checkpoint``'s weights (quantized per LAYER_TYPES) plus its
    reference: a float32 checkpoint folder holding exactly the dequantized
    weights. Returns (folder that names the GGUF, reference folder)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((checkpoint / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    state = load_file(str(checkpoint / "model.safetensors"))
    gguf_path = out_dir / "tiny.gguf"
    # The family's llama.cpp names (its declaration), as llama.cpp's converter
    # writes them: q/k rows permuted for the "llama" architecture only.
    layout = get_model_class(config["architectures"][0]).declaration.gguf
    assert layout is not None
    permuted = layout.permuted_qk
    writer = GGUFWriter(gguf_path, layout.architecture)
    reference: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str, kind: GGMLQuantizationType, permute: int = 0) -> None:
        weight = state[hf_name].float().numpy()
        if permute:
            weight = llama_cpp_permute(weight, permute)
        if kind in (F32, F16):
            data = weight.astype(np.float16 if kind == F16 else np.float32)
            writer.add_tensor(gguf_name, data)
            back = data.astype(np.float32)
        else:
            data = quantize(weight, kind)
            writer.add_tensor(gguf_name, data, raw_dtype=kind)
            back = dequantize(data, kind)
        if permute:  # the reference holds the Hugging Face row order
            back = _inverse_permute(back.reshape(weight.shape), permute)
        reference[hf_name] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))

    add("token_embd.weight", "model.embed_tokens.weight", embedding_type)
    add("output_norm.weight", "model.norm.weight", F32)
    if "lm_head.weight" in state:
        add("output.weight", "lm_head.weight", Q8_0)
    for layer in range(config["num_hidden_layers"]):
        for part, hf_part in layout.layer_names.items():
            kind = LAYER_TYPES.get(part, F32)
            permute = {"attn_q": heads, "attn_k": kv_heads}.get(part, 0) if permuted else 0
            add(
                f"blk.{layer}.{part}.weight",
                f"model.layers.{layer}.{hf_part}.weight",
                kind,
                permute,
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ref_dir = out_dir / "reference"
    shutil.copytree(checkpoint, ref_dir)
    save_file(reference, str(ref_dir / "model.safetensors"))
    named = out_dir / "named"
    named.mkdir()
    shutil.copy(checkpoint / "config.json", named / "config.json")
    (named / GGUF_MARKER).write_text(json.dumps({"gguf_file": str(gguf_path)}))
    return named, ref_dir


def _inverse_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """transformers' reverse_permute_weights: undoes ``llama_cpp_permute``."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(2, 1)
        .reshape(weight.shape)
    )
