"""Every family llama.cpp converts, served from its GGUF file.

Each family's tiny random checkpoint is written to GGUF the way llama.cpp's
converter (and llama-quantize) would (tests/worker/gguf_family_files.py, names
from the ``gguf`` package's own map), then:

* the config read from the GGUF metadata gives the same ModelConfig facts,
  the same forward switches (Features) and KV-cache spec as config.json;
* an F32 file gives the safetensors checkpoint's logits (bit for bit, but for
  Gemma, whose converter stores each norm as w + 1 in float32: a rounding);
* F16, Q8_0 and Q4_K_M files give the logits of a float32 checkpoint of the
  weights the ``gguf`` package dequantizes from them, on a decode-sized and a
  prefill-sized prompt, with the projections on the file's own blocks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGUFWriter
from transformers import AutoTokenizer

from kvmesh.services.runtime.model_prep import GGUF_MARKER, _installed_gguf
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.gguf_config import gguf_hf_config, prepare_model_folder, write_gguf_config
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.config_checks import UnsupportedModelError
from kvmesh.worker.models.ggml_linear import MAX_GGML_KERNEL_ROWS
from kvmesh.worker.models.registry import get_model_class

from .gguf_family_files import TokenizerFields, tokenizer_fields, write_family_gguf
from .model_families import make_family_checkpoint
from .parallel_ranks import RunSpec, run_replica, run_single
from .test_worker_model_loader import _our_logits
from .test_worker_parallel_replica import assert_same_outputs

FAMILIES = [
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    "SmolLM3ForCausalLM",
]
# Rows of 256 weights: K-quant super-blocks fit the hidden and MLP widths.
SIZES = {"hidden_size": 256, "intermediate_size": 256}
# llama.cpp does not store Gemma's query_pre_attn_scalar (it assumes head_dim)
# and has no untied Gemma 2 head (every Gemma ties it).
_GEMMA = {"query_pre_attn_scalar": 16, "tie_word_embeddings": True}
OVERRIDES = {"Gemma2ForCausalLM": _GEMMA, "Gemma3ForCausalLM": _GEMMA}
PROMPT = [(7 * i + 3) % 160 for i in range(MAX_GGML_KERNEL_ROWS + 8)]
PROMPT_LENGTHS = (5, len(PROMPT))  # the block kernel; tiles + GEMM
TP_PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [7] * 20 + [1, 2, 3], [100, 30]]
# Facts compared between the two configs (the rest name the files).
_SKIPPED_FIELDS = ("path", "gguf_file", "hf_config", "checkpoint_dtype")


def _runner(folder: Path) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(folder, max_model_len=256),
        CacheConfig(block_size=16, num_kv_blocks=16),
        num_threads=1,
    )


def _named(gguf: Path, folder: Path) -> Path:
    """A folder serving ``gguf`` with the config its metadata gives (no tokenizer:
    these checkpoints' ids are synthetic)."""
    write_gguf_config(gguf, folder)
    (folder / GGUF_MARKER).write_text(json.dumps({"gguf_file": str(gguf.resolve())}))
    return folder


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, Path]:
    architecture = request.param
    folder = tmp_path_factory.mktemp(architecture) / "checkpoint"
    make_family_checkpoint(folder, architecture, **SIZES, **OVERRIDES.get(architecture, {}))
    return architecture, folder


def test_gguf_metadata_gives_the_checkpoint_config(family: tuple[str, Path]) -> None:
    architecture, checkpoint = family
    files = write_family_gguf(checkpoint, checkpoint.parent / "gguf", "F32")
    ours = ModelConfig.from_pretrained(_named(files.gguf, checkpoint.parent / "named-config"))
    theirs = ModelConfig.from_pretrained(checkpoint)
    for field in dataclasses.fields(ModelConfig):
        if field.name not in _SKIPPED_FIELDS:
            assert getattr(ours, field.name) == getattr(theirs, field.name), field.name
    model_class = get_model_class(architecture)
    model_class.check_config(ours)
    assert model_class.family_features(ours) == model_class.family_features(theirs)
    assert model_class.kv_cache_spec(ours) == model_class.kv_cache_spec(theirs)


def test_f32_gguf_gives_the_checkpoint_logits(family: tuple[str, Path]) -> None:
    architecture, checkpoint = family
    files = write_family_gguf(checkpoint, checkpoint.parent / "gguf", "F32")
    ours = _runner(_named(files.gguf, checkpoint.parent / "named-F32"))
    theirs = _runner(checkpoint)
    for length in PROMPT_LENGTHS:
        got, want = _our_logits(ours, PROMPT[:length]), _our_logits(theirs, PROMPT[:length])
        if architecture.startswith("Gemma"):
            # fl(w + 1) - 1 is w to within one float32 rounding of the norm weight.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("quant", ["F16", "Q8_0", "Q4_K_M"])
def test_quantized_gguf_gives_its_dequantized_logits(family: tuple[str, Path], quant: str) -> None:
    _, checkpoint = family
    files = write_family_gguf(checkpoint, checkpoint.parent / "gguf", quant)
    ours = _runner(_named(files.gguf, checkpoint.parent / f"named-{quant}"))
    reference = _runner(files.reference)
    for length in PROMPT_LENGTHS:
        got, want = _our_logits(ours, PROMPT[:length]), _our_logits(reference, PROMPT[:length])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    if quant != "F16":
        # Every projection runs on the file's blocks (the experts run dense).
        with_codes, total = ours.model.block_code_coverage()
        assert with_codes == total


def test_an_architecture_no_family_reads_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "bloom.gguf"
    writer = GGUFWriter(path, "bloom")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError) as error:
        gguf_hf_config(path)
    message = str(error.value)
    assert "unsupported GGUF architecture 'bloom'" in message
    assert "qwen3moe (Qwen3MoeForCausalLM)" in message and "gemma2 (Gemma2ForCausalLM)" in message


def test_a_partial_rotary_is_refused(tmp_path: Path) -> None:
    """A GGUF fact kvmesh does not implement is refused, never guessed."""
    path = tmp_path / "partial.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_head_count(4)
    writer.add_rope_dimension_count(8)  # of a 64-wide head
    writer.add_tensor("token_embd.weight", torch.zeros(4, 256).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"rope\.dimension_count 8"):
        gguf_hf_config(path)


@pytest.fixture(scope="module")
def default_tokenizer() -> tuple[TokenizerFields, Any]:
    """The default model's GGUF tokenizer metadata, and transformers' tokenizer of it."""
    source = _installed_gguf()
    if source is None:
        pytest.skip("the default model's GGUF is not installed")
    theirs = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    return tokenizer_fields(source), theirs


@pytest.mark.model
def test_a_granite_gguf_file_serves_from_its_path_alone(
    default_tokenizer: tuple[TokenizerFields, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--model x.gguf``: the config from the metadata, the tokenizer from its
    tokenizer.ggml.* keys (transformers reads no Granite GGUF config, so not
    through AutoTokenizer's GGUF path), and the weights from the file."""
    architecture = "GraniteForCausalLM"
    fields, theirs = default_tokenizer
    monkeypatch.setenv("KVMESH_MODEL_CACHE", str(tmp_path / "cache"))
    checkpoint = tmp_path / "checkpoint"
    make_family_checkpoint(checkpoint, architecture, **SIZES)
    files = write_family_gguf(checkpoint, tmp_path / "gguf", "Q8_0", tokenizer=fields)
    with pytest.raises(FileNotFoundError, match="prepare_model_folder"):
        ModelConfig.from_pretrained(files.gguf, max_model_len=256)  # the worker writes it
    config = ModelConfig.from_pretrained(prepare_model_folder(str(files.gguf)), max_model_len=256)
    assert config.architecture == architecture
    assert config.gguf_file == str(files.gguf.resolve())
    assert config.eos_token_ids == (2,)  # the tokenizer's <|im_end|>, from the metadata
    folder = Path(config.path)
    ours = AutoTokenizer.from_pretrained(folder)
    for text in ("Hello world", "  spaced  out\n\nünïcode 123", "<|im_start|>user\nhi<|im_end|>"):
        assert ours(text).input_ids == theirs(text).input_ids
    runner = _runner(folder)
    reference = _runner(files.reference)
    got, want = _our_logits(runner, PROMPT[:5]), _our_logits(reference, PROMPT[:5])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize(
    "architecture", ["Phi3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"]
)
def test_family_gguf_blocks_shard_over_two_ranks(architecture: str, tmp_path: Path) -> None:
    """TP=2 over a family's Q8_0 file gives TP=1's tokens: Phi-3's fused
    blocks cut run by run, Gemma's offset norms, MoE expert stacks sliced
    (columns split on 32-wide blocks: hidden 64, MLP 128)."""
    checkpoint = tmp_path / "checkpoint"
    make_family_checkpoint(
        checkpoint, architecture, intermediate_size=128, **OVERRIDES.get(architecture, {})
    )
    files = write_family_gguf(checkpoint, tmp_path / "gguf", "Q8_0")
    spec = RunSpec(str(_named(files.gguf, tmp_path / "named")), TP_PROMPTS, chunk_size=8)
    assert_same_outputs(run_single(spec), run_replica(2, 1, spec))


def test_llama3_rope_freqs_give_the_scaled_rope(tmp_path: Path) -> None:
    """Llama 3.x's rope scaling travels only as the converter's rope_freqs
    tensor: read as per-pair divisors, the logits are the checkpoint's (within
    the float32 rounding of the divisors), and far from plain rope's."""
    checkpoint = tmp_path / "checkpoint"
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 10_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    make_family_checkpoint(checkpoint, "LlamaForCausalLM", **SIZES, rope_parameters=llama3)
    files = write_family_gguf(checkpoint, tmp_path / "gguf", "F32")
    named = _named(files.gguf, tmp_path / "named")
    assert (
        json.loads((named / "config.json").read_text())["rope_scaling"]["rope_type"] == "longrope"
    )
    got = _our_logits(_runner(named), PROMPT)
    want = _our_logits(_runner(checkpoint), PROMPT)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    plain = tmp_path / "plain"
    make_family_checkpoint(plain, "LlamaForCausalLM", **SIZES)
    assert not torch.allclose(_our_logits(_runner(plain), PROMPT), want, rtol=1e-3, atol=1e-3)
