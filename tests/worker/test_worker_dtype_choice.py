"""``--dtype auto`` picks bfloat16 where the CPU has bf16 matmul instructions, float32
elsewhere, says why, and never overrides an explicit dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.services.runtime.config import WorkerConfig
from kvmesh.services.runtime.cpu_features import CpuFeatures
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.dtype_choice import choose_dtype

XEON_AMX = CpuFeatures(
    "Intel Xeon Platinum 8481C",
    frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16", "avx512_bf16"}),
)
EPYC_BF16 = CpuFeatures("AMD EPYC 9B14", frozenset({"avx2", "avx512f", "avx512_bf16"}))
EPYC_AVX2 = CpuFeatures("AMD EPYC 7B12", frozenset({"avx2", "fma"}))
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9B14
flags\t\t: fpu
"""


def test_cpuinfo_is_read_from_the_first_processor() -> None:
    features = CpuFeatures.parse(CPUINFO)
    assert features.model_name == "AMD EPYC 9B14"
    assert features.avx512_bf16 and not features.amx_bf16
    assert features.isa_summary() == "avx512_bf16, avx512_vnni, avx512f, avx2"


@pytest.mark.parametrize(
    ("features", "dtype", "why"),
    [
        (XEON_AMX, torch.bfloat16, "AMX-BF16"),
        (EPYC_BF16, torch.bfloat16, "AVX512-BF16"),
        (EPYC_AVX2, torch.float32, "no bf16 matmul instructions"),
    ],
)
def test_auto_follows_the_cpus_bf16_instructions(
    features: CpuFeatures, dtype: torch.dtype, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    choice = choose_dtype("auto", "cpu", torch.float32, features)
    assert choice is not None
    assert choice.dtype == dtype
    assert why in choice.reason and features.model_name in choice.reason


def test_auto_stays_float32_where_onednn_has_no_bf16_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    choice = choose_dtype("auto", "cpu", torch.float32, XEON_AMX)
    assert choice is not None and choice.dtype == torch.float32


def test_auto_on_cuda_keeps_a_16_bit_checkpoint_and_narrows_a_float32_one() -> None:
    assert choose_dtype("auto", "cuda", torch.float16).dtype == torch.float16
    assert choose_dtype("auto", "cuda", torch.float32).dtype == torch.bfloat16


def test_an_explicit_dtype_is_not_chosen(tmp_path: Path) -> None:
    assert choose_dtype("float32", "cpu", torch.float32, XEON_AMX) is None
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "num_attention_heads": 2, "hidden_size": 8,'
        '"num_hidden_layers": 1, "intermediate_size": 16, "vocab_size": 32}'
    )
    config = ModelConfig.from_pretrained(tmp_path, dtype="float32")
    assert (config.dtype, config.dtype_reason) == (torch.float32, "--dtype float32")
    auto = ModelConfig.from_pretrained(tmp_path, dtype="auto")
    assert auto.dtype in (torch.float32, torch.bfloat16)
    assert auto.dtype_reason.startswith("auto: ")


def test_the_worker_flag_defaults_to_auto() -> None:
    assert WorkerConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype"):
        WorkerConfig(dtype="int4")
