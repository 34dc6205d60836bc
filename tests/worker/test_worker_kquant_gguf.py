"""The default model in llama.cpp's K-quant mixes, loaded from the GGUF blocks.

Files written by tests/worker/kquant_files.py (cached in the model cache after
the first run): each must give the logits of a float32 checkpoint holding the
``gguf`` package's dequantization of its weights, within float32 rounding, on a
decode-sized prompt (the kernel over the blocks) and a prefill-sized one (tiles
rebuilt into scratch + GEMM), while holding about the file's bytes.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from kvmesh.kernels.ggml_blocks import GGMLRows
from kvmesh.worker.gguf_weights import (
    UnsupportedGGUFType,
    iterate_gguf_weights,
    reads_as_blocks,
)
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.ggml_linear import MAX_GGML_KERNEL_ROWS
from kvmesh.worker.models.llama import LlamaForCausalLM
from tests.worker.kquant_files import MIXES, MixFiles, write_mix

from .test_worker_model_loader import _our_logits

pytestmark = pytest.mark.model

Q = GGMLQuantizationType
# Decode-sized (the kernel) and prefill-sized (tiles + GEMM) prompts.
PROMPT_LENGTHS = (5, MAX_GGML_KERNEL_ROWS + 8)

LLAMA = LlamaForCausalLM.declaration  # the default model's family: its GGUF names


def _runner(folder: Path) -> ModelRunner:
    from kvmesh.worker.config import CacheConfig, ModelConfig

    return ModelRunner(
        ModelConfig.from_pretrained(folder, max_model_len=256),
        CacheConfig(block_size=16, num_kv_blocks=16),  # 256 tokens
        num_threads=1,
    )


@pytest.fixture(scope="module", params=MIXES)
def mix_files(request, model_path: Path) -> tuple[str, MixFiles]:
    return request.param, write_mix(model_path, request.param)


def test_kquant_logits_are_the_dequantized_weights(
    mix_files: tuple[str, MixFiles], prompts: list[list[int]], caplog
) -> None:
    mix, files = mix_files
    with caplog.at_level(logging.INFO, logger="kvmesh.worker.model_loader"):
        ours = _runner(files.folder)
    assert files.reference is not None
    reference = _runner(files.reference)
    for length in PROMPT_LENGTHS:
        prompt = (prompts[2] * 4)[:length]
        assert len(prompt) == length
        want = _our_logits(reference, prompt)
        got = _our_logits(ours, prompt)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Every projection runs on codes; none was dequantized to a dense copy.
    with_codes, total = ours.model.block_code_coverage()
    assert with_codes == total
    # Resident weights, as the worker reports them, stay near the file's size.
    reported = [
        int(m.group(1))
        for r in caplog.records
        if (m := re.match(r"resident weight bytes: (\d+)", r.getMessage()))
    ]
    assert reported == [ours.model.resident_weight_bytes()]
    file_bytes = files.gguf.stat().st_size
    if mix != "Q8_0":  # a Q8_0 file keeps the panel layout (1.25 bytes per weight)
        assert reported[0] <= 1.2 * file_bytes, (mix, reported[0], file_bytes)


def test_q4_k_m_file_keeps_k_quant_super_blocks(model_path: Path) -> None:
    files = write_mix(model_path, "Q4_K_M")
    kinds: set[GGMLQuantizationType] = set()
    for _, tensor in iterate_gguf_weights(files.gguf, LLAMA, 9, 3):
        if isinstance(tensor, GGMLRows):
            kinds.update(tensor.kinds)
    # SmolLM2's 576-wide rows fall back to Q5_0 (and Q8_0 for Q6_K), as in
    # llama.cpp; its 1,536-wide ffn_down rows are K-quants.
    assert kinds == {Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0}


def test_unsupported_type_is_refused_by_name_unless_dense_is_asked(tmp_path: Path) -> None:
    path = tmp_path / "q2k.gguf"
    writer = GGUFWriter(path, "llama")
    raw = np.random.default_rng(0).integers(0, 256, (4, 84), dtype=np.uint8)  # Q2_K: 84 B / 256
    raw[:, 80:84] = np.float16(0.01).reshape(1, 1).view(np.uint8).repeat(2, axis=1)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=Q.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedGGUFType, match="Q2_K"):
        list(iterate_gguf_weights(path, LLAMA, 2, 2))
    [(name, dense)] = list(iterate_gguf_weights(path, LLAMA, 2, 2, allow_dense=True))
    assert name == "model.layers.0.self_attn.q_proj.weight"
    assert isinstance(dense, torch.Tensor) and dense.shape == (4, 256)


def test_which_files_read_as_their_own_blocks() -> None:
    # Any K-quant (or Q5_0/Q5_1): every quantized tensor stays the file's blocks.
    assert reads_as_blocks([Q.Q4_K, Q.Q8_0, Q.F32], int8_activations=False)
    # Q4_0/Q4_1/Q8_0 only: the panel codes, unless the file is Q8_0 only and
    # runs on int8 activations (--quantization w8a8: the Q8_0 block kernels).
    assert not reads_as_blocks([Q.Q8_0, Q.F32], int8_activations=False)
    assert reads_as_blocks([Q.Q8_0, Q.F32], int8_activations=True)
    assert not reads_as_blocks([Q.Q4_1, Q.Q8_0, Q.F32], int8_activations=True)
    assert not reads_as_blocks([Q.F16, Q.F32], int8_activations=True)
