"""GGUF files of any family's tiny checkpoint, laid out as llama.cpp's converter lays them out.

``write_family_gguf(checkpoint, out, quant)`` plays convert_hf_to_gguf.py (and,
for Q8_0 / Q4_K_M, llama-quantize) on a Hugging Face folder, independently of
kvmesh's declarations: tensor names come from the ``gguf`` package's own map
(``gguf.get_tensor_name_map``, which the converter uses), metadata through the
``GGUFWriter.add_*`` calls the converter makes per architecture, and the
converter's quirks are written out here: q/k rows permuted for its
LlamaModel-based classes (Llama, Mistral, Mixtral, Granite, SmolLM3), ``w + 1`` for
Gemma's norms, experts stacked into ``ffn_*_exps`` [experts, rows, cols],
Phi-3's fused tensors kept, the router and the norms in F32.

It returns the GGUF and a float32 reference folder holding exactly the
weights the ``gguf`` package dequantizes from the file (the accuracy oracle).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    get_tensor_name_map,
)
from gguf.quants import dequantize

from kvmesh.kernels.ggml_quantize import quantize
from tests.worker.kquant_files import tensor_type

Q = GGMLQuantizationType
QUANTS = ("F32", "F16", "Q8_0", "Q4_K_M")


@dataclass(frozen=True)
class Converter:
    """What convert_hf_to_gguf.py does for one Hugging Face architecture."""

    arch: MODEL_ARCH
    permute_qk: bool = False  # its LlamaModel subclasses
    norm_plus_one: bool = False  # Gemma 2/3
    expert_block: str = ""  # module holding the experts, for the merged names
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


CONVERTERS: dict[str, Converter] = {
    "LlamaForCausalLM": Converter(MODEL_ARCH.LLAMA, permute_qk=True),
    "Qwen2ForCausalLM": Converter(MODEL_ARCH.QWEN2),
    "Qwen3ForCausalLM": Converter(MODEL_ARCH.QWEN3),
    "Qwen3MoeForCausalLM": Converter(MODEL_ARCH.QWEN3MOE, expert_block="mlp"),
    "MixtralForCausalLM": Converter(
        MODEL_ARCH.LLAMA,
        permute_qk=True,
        expert_block="block_sparse_moe",
        expert_names=("w1", "w3", "w2"),
    ),
    "Gemma2ForCausalLM": Converter(MODEL_ARCH.GEMMA2, norm_plus_one=True),
    "Gemma3ForCausalLM": Converter(MODEL_ARCH.GEMMA3, norm_plus_one=True),
    "Phi3ForCausalLM": Converter(MODEL_ARCH.PHI3),
    "Olmo2ForCausalLM": Converter(MODEL_ARCH.OLMO2),
    "GraniteForCausalLM": Converter(MODEL_ARCH.GRANITE, permute_qk=True),
    "SmolLM3ForCausalLM": Converter(MODEL_ARCH.SMOLLM3, permute_qk=True),
}


@dataclass(frozen=True)
class FamilyGGUF:
    gguf: Path
    reference: Path  # float32 checkpoint of the weights the file dequantizes to


def _permute(weight: np.ndarray, num_heads: int, inverse: bool = False) -> np.ndarray:
    """The converter's q/k row permutation (interleaved rotary halves), or its inverse."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    if inverse:
        return (
            weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape)
        )
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _llama3_rope_freqs(hf: dict[str, Any]) -> np.ndarray | None:
    """The converter's ``rope_freqs`` for a ``llama3`` rope scaling: per rotary
    pair, 1 for short wavelengths, ``factor`` for long ones, a smooth blend
    between (its only record of the scaling: no metadata keys)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type") != "llama3":
        return None
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    base = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    wavelengths = 2 * np.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (original / wavelengths - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(
        wavelengths < original / high, 1.0, np.where(wavelengths > original / low, factor, blended)
    )
    return factors.astype(np.float32)


def _metadata(writer: GGUFWriter, hf: dict[str, Any], architecture: str) -> None:
    """The converter's set_gguf_parameters for these architectures."""
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hf.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    rope = hf.get("rope_parameters") or {}
    if architecture == "Gemma3ForCausalLM":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"]])
    else:
        writer.add_rope_freq_base(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        writer.add_sliding_window(hf["sliding_window"])
    for field, add in (
        ("attn_logit_softcapping", writer.add_attn_logit_softcapping),
        ("final_logit_softcapping", writer.add_final_logit_softcapping),
        ("attention_multiplier", writer.add_attention_scale),
        ("embedding_multiplier", writer.add_embedding_scale),
        ("residual_multiplier", writer.add_residual_scale),
        ("logits_scaling", writer.add_logit_scale),
        ("moe_intermediate_size", writer.add_expert_feed_forward_length),
        ("num_experts_per_tok", writer.add_expert_used_count),
    ):
        if hf.get(field) is not None:
            add(hf[field])
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
    if architecture == "Qwen3MoeForCausalLM":
        writer.add_expert_weights_norm(bool(hf["norm_topk_prob"]))


# A GGUF file's tokenizer.* metadata: (key, value type, value).
TokenizerFields = list[tuple[str, GGUFValueType, Any]]


def tokenizer_fields(source: Path) -> TokenizerFields:
    """The ``tokenizer.*`` metadata of a GGUF file (the default model's: the
    converter's gpt2 BPE vocabulary, merges and special ids), read once."""
    reader = GGUFReader(str(source))
    return [
        (name, field.types[0], field.contents())
        for name, field in reader.fields.items()
        if name.startswith("tokenizer.")
    ]


def _copy_tokenizer(writer: GGUFWriter, fields: TokenizerFields) -> None:
    for name, kind, value in fields:
        if kind == GGUFValueType.ARRAY:
            writer.add_array(name, value)
        elif kind == GGUFValueType.STRING:
            writer.add_string(name, value)
        elif kind == GGUFValueType.BOOL:
            writer.add_bool(name, value)
        else:
            writer.add_uint32(name, int(value))


def write_family_gguf(
    checkpoint: Path, out_dir: Path, quant: str, tokenizer: TokenizerFields | None = None
) -> FamilyGGUF:
    """``checkpoint`` converted (and quantized: ``quant`` in QUANTS) the way
    llama.cpp does, carrying ``tokenizer`` (tokenizer_fields) if given."""
    from safetensors.torch import load_file, save_file

    hf = json.loads((checkpoint / "config.json").read_text())
    architecture = hf["architectures"][0]
    converter = CONVERTERS[architecture]
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    layers = hf["num_hidden_layers"]
    state = {
        k: v.float().numpy() for k, v in load_file(str(checkpoint / "model.safetensors")).items()
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{checkpoint.name}-{quant}.gguf"
    names = get_tensor_name_map(converter.arch, layers)
    writer = GGUFWriter(path, MODEL_ARCH_NAMES[converter.arch])
    _metadata(writer, hf, architecture)
    if tokenizer is not None:
        _copy_tokenizer(writer, tokenizer)
    reference: dict[str, torch.Tensor] = {}
    rope_freqs = _llama3_rope_freqs(hf)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)

    tied = "lm_head.weight" not in state

    def kind_of(gguf_name: str, weight: np.ndarray) -> GGMLQuantizationType:
        """llama-quantize's choice: norms and the router F32, the rest by the mix."""
        if weight.ndim == 1 or gguf_name.endswith("ffn_gate_inp.weight") or quant == "F32":
            return Q.F32
        if quant == "F16":
            return Q.F16
        pieces = gguf_name.split(".")
        layer, part = (int(pieces[1]), pieces[2]) if pieces[0] == "blk" else (0, pieces[0])
        if part == "token_embd" and tied:
            part = "output"  # a tied embedding is the head
        return tensor_type(quant, part, layer, layers, weight.shape[-1])

    def add(gguf_name: str, weight: np.ndarray, hf_names: list[str], permute: int = 0) -> None:
        """Write one tensor; the reference gets what the file dequantizes to
        (unpermuted, split per expert), in the Hugging Face names."""
        kind = kind_of(gguf_name, weight)
        if converter.norm_plus_one and gguf_name.endswith("norm.weight"):
            weight = weight + 1  # what the converter stores; the reference keeps w
        stored = _permute(weight, permute) if permute else weight
        if kind in (Q.F32, Q.F16):
            data = stored.astype(np.float16 if kind == Q.F16 else np.float32)
            writer.add_tensor(gguf_name, data)
            back = data.astype(np.float32)
        else:
            rows = stored.reshape(-1, stored.shape[-1])
            data = quantize(rows, kind).reshape(*stored.shape[:-1], -1)
            writer.add_tensor(gguf_name, data, raw_dtype=kind)
            back = dequantize(data, kind).reshape(stored.shape)
        if permute:
            back = _permute(back, permute, inverse=True)
        if converter.norm_plus_one and gguf_name.endswith("norm.weight"):
            back = state[hf_names[0]]  # F32, stored exactly: the checkpoint's own w
        pieces = back if len(hf_names) > 1 else [back]
        for hf_name, piece in zip(hf_names, pieces, strict=True):
            reference[hf_name] = torch.from_numpy(np.ascontiguousarray(piece, dtype=np.float32))

    experts: dict[tuple[int, str], list[str]] = {}
    for hf_name in state:
        stem, suffix = hf_name.rsplit(".", 1)
        if ".experts." in stem and converter.expert_block:
            head, _, tail = stem.partition(".experts.")
            _, _, matrix = tail.partition(".")
            layer = int(head.split(".")[2])
            experts.setdefault((layer, matrix), []).append(hf_name)
            continue
        gguf_stem = names.get_name(stem)
        assert gguf_stem is not None, (
            f"the gguf package has no {converter.arch.name} name for {stem}"
        )
        permute = 0
        if converter.permute_qk and stem.endswith("self_attn.q_proj"):
            permute = heads
        elif converter.permute_qk and stem.endswith("self_attn.k_proj"):
            permute = kv_heads
        add(f"{gguf_stem}.{suffix}", state[hf_name], [hf_name], permute)
    block = converter.expert_block
    for (layer, matrix), hf_names in sorted(experts.items()):
        # The converter's merged name, mapped like any other.
        hf_names.sort(key=lambda n: int(n.split(".experts.")[1].split(".")[0]))
        gguf_stem = names.get_name(f"model.layers.{layer}.{block}.experts.{matrix}")
        assert gguf_stem is not None, matrix
        add(f"{gguf_stem}.weight", np.stack([state[n] for n in hf_names]), hf_names)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ref_dir = out_dir / f"reference-{quant}"
    ref_dir.mkdir(exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (checkpoint / name).is_file():
            shutil.copy(checkpoint / name, ref_dir / name)
    save_file(reference, str(ref_dir / "model.safetensors"))
    return FamilyGGUF(path, ref_dir)
