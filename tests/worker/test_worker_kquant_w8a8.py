"""--quantization w8a8 on a GGUF file's blocks: the default model in Q4_K_M.

Decode-sized batches multiply activations quantized to int8 per 32 features
with the blocks' integer codes (kernels/csrc/ggml_q8_linear.cpp, llama.cpp's
arithmetic). Against the float32 checkpoint, the teacher-forced top-1
agreement on FIXED_TEXT (one batch of the kernel: every projection on int8
activations) must stay near the exact float-activation path's. Measured on
the 87 positions: exact 86.2%, w8a8 87.4% (llama.cpp's own Q4_K_M file of the
model: 87.4% both ways).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models import ggml_linear
from kvmesh.worker.models.ggml_linear import MAX_GGML_KERNEL_ROWS, GGMLLinear
from tests.worker.kquant_files import write_mix
from tests.worker.quant_accuracy import FIXED_TEXT

from .test_worker_model_loader import _our_logits

pytestmark = pytest.mark.model

# Top-1 agreement points w8a8 may lose against the exact path (measured: see
# the test's assertion message); a kernel that dropped a term (a sub-block's
# minimum, an activation scale) agrees on almost nothing.
ALLOWED_LOSS = 0.05


def _runner(folder: Path, quantization: str | None = None) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(folder, max_model_len=256, quantization=quantization),
        CacheConfig(block_size=16, num_kv_blocks=16),  # 256 tokens
        num_threads=1,
    )


def test_q4_k_m_on_int8_activations_keeps_its_top1_agreement(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The whole prompt on the int8 kernels: served, batches from
    # FLOAT_GEMM_MIN_ROWS_W8A8 (past MAX_GGML_Q8_KERNEL_ROWS elsewhere) run
    # float32 weights, which would make this the exact path.
    monkeypatch.setattr(ggml_linear, "FLOAT_GEMM_MIN_ROWS_W8A8", 1 << 30)
    monkeypatch.setattr(ggml_linear, "MAX_GGML_Q8_KERNEL_ROWS", 1 << 30)
    files = write_mix(model_path, "Q4_K_M", with_reference=False)
    ids = AutoTokenizer.from_pretrained(model_path)(FIXED_TEXT).input_ids
    assert len(ids) <= MAX_GGML_KERNEL_ROWS  # one batch of the kernel
    float32 = _our_logits(_runner(model_path), ids).argmax(-1)
    exact_runner, w8a8_runner = _runner(files.folder), _runner(files.folder, "w8a8")
    projections = [p for p in w8a8_runner.model._all_packed() if isinstance(p, GGMLLinear)]
    assert projections and all(p._int8_activations for p in projections)
    exact_logits = _our_logits(exact_runner, ids)
    w8a8_logits = _our_logits(w8a8_runner, ids)
    assert not torch.equal(exact_logits, w8a8_logits)
    exact = float((exact_logits.argmax(-1) == float32).float().mean())
    w8a8 = float((w8a8_logits.argmax(-1) == float32).float().mean())
    assert w8a8 >= exact - ALLOWED_LOSS, (exact, w8a8)
