"""The step token budget a worker names for its hardware (WorkerInfo.step_token_budget)."""

from __future__ import annotations

import torch

from kvmesh.services.runtime.cpu_features import CpuFeatures
from kvmesh.worker.step_budget import LONG_STEP_TOKENS, SHORT_STEP_TOKENS, preferred_step_tokens

AMX_XEON = CpuFeatures(
    "Intel(R) Xeon(R) Platinum 8488C",
    frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}),
)
ZEN4_EPYC = CpuFeatures("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"}))
AVX2_ONLY = CpuFeatures("AMD EPYC 7B12", frozenset({"avx2", "fma"}))


def test_bf16_on_amx_tiles_keeps_long_steps() -> None:
    assert preferred_step_tokens("cpu", torch.bfloat16, AMX_XEON) == LONG_STEP_TOKENS == 2048


def test_cpus_whose_matmuls_are_flat_per_row_take_short_steps() -> None:
    assert preferred_step_tokens("cpu", torch.bfloat16, ZEN4_EPYC) == SHORT_STEP_TOKENS == 1024
    assert preferred_step_tokens("cpu", torch.float32, AVX2_ONLY) == SHORT_STEP_TOKENS
    # float32 matmuls use no AMX tiles, even where the CPU has them.
    assert preferred_step_tokens("cpu", torch.float32, AMX_XEON) == SHORT_STEP_TOKENS


def test_accelerators_keep_long_steps() -> None:
    for device in ("cuda", "cuda:1"):
        assert preferred_step_tokens(device, torch.bfloat16, ZEN4_EPYC) == LONG_STEP_TOKENS
