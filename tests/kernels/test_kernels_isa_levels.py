"""The C++ kernels at every instruction-set level this CPU runs (kernels/cpu_isa.py).

One library is loaded per process, so each other level runs in a child
process: the kernel test files with their own tolerances, and the block-code
linear's float32 results, which must be bitwise equal on the vector levels
(AVX2 splits each 16-lane panel into two halves but keeps every operation and
its order; amx runs float32 rows as avx512_bf16 does), and the W8A8 linear's
(exact int32 block sums and the same float32 operations on every path:
portable, vpdpbusd, AMX-INT8). Its bfloat16 results on AMX tiles and with
vdpbf16ps (avx512_bf16) round the same bfloat16 weights and differ only by
float32 summation order. Levels the CPU lacks are skipped with
the flags it lacks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvmesh.kernels import native
from kvmesh.kernels.cpu_isa import IsaLevel, all_levels, choose_level, is_x86
from kvmesh.services.runtime.config.process import CPU_ISA
from kvmesh.services.runtime.cpu_features import CpuFeatures

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU = CpuFeatures.detect()
KERNEL_TESTS = (
    "tests/kernels/test_kernels_block_codes.py",
    "tests/kernels/test_kernels_int8_linear.py",
    "tests/kernels/test_kernels_elementwise.py",
    "tests/kernels/test_kernels_cpu_native.py",
    "tests/kernels/test_kernels_prefill_attention.py",
    "tests/kernels/test_kernels_kv_quant.py",
    "tests/kernels/test_kernels_fused_moe.py",
)
VECTOR_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")


def _runnable_or_skip(level: IsaLevel) -> None:
    if missing := level.missing(CPU):
        pytest.skip(f"{CPU.model_name} cannot run {level.name}: no {', '.join(missing)}")


def _child_env(level: IsaLevel) -> dict[str, str]:
    return {**os.environ, CPU_ISA.name: level.name}


def test_auto_loads_the_best_level_this_cpu_runs() -> None:
    level = native.loaded_level()
    assert level is not None, native.unavailable_reason()
    assert level == choose_level(CPU, CPU_ISA.get()).level
    if CPU_ISA.get() == "auto" and is_x86():
        assert not any(
            not other.missing(CPU) for other in all_levels()[all_levels().index(level) + 1 :]
        ), "a better level runs here"


def _fake_cpu(*flag_sets: frozenset[str]) -> CpuFeatures:
    return CpuFeatures("test CPU", frozenset().union(*flag_sets))


@pytest.mark.skipif(not is_x86(), reason="x86 levels")
def test_choice_follows_the_flags_and_refuses_what_the_cpu_lacks() -> None:
    generic, avx2, avx512, avx512_bf16, amx = all_levels()
    assert choose_level(_fake_cpu(avx2.required_cpu_flags)).level == avx2
    # AMX-BF16 without the tile flag (never seen, but each is its own cpuid bit).
    assert choose_level(_fake_cpu(avx512_bf16.required_cpu_flags, {"amx_bf16"})).level == (
        avx512_bf16
    )
    amx_flags = {"amx_bf16", "amx_tile", "amx_int8"}
    assert choose_level(_fake_cpu(avx512_bf16.required_cpu_flags, amx_flags)).level == amx
    # The amx level's W8A8 path needs AMX-INT8 too (every AMX CPU so far has it).
    assert choose_level(
        _fake_cpu(avx512_bf16.required_cpu_flags, amx_flags - {"amx_int8"})
    ).level == (avx512_bf16)
    assert amx.bf16_dot_products and amx.amx_tiles and not avx512_bf16.amx_tiles
    # paged_prefill_attention is built from avx2 up (float32), bfloat16 where dot products are.
    assert [level.avx2 for level in all_levels()] == [False, True, True, True, True]
    assert [level.bf16_dot_products for level in all_levels()] == [False, False, False, True, True]
    assert choose_level(_fake_cpu(avx512.required_cpu_flags), "generic").level == generic
    with pytest.raises(ValueError, match=r"cannot run the avx512 level: no \['avx512bw'"):
        choose_level(_fake_cpu(avx2.required_cpu_flags, {"avx512f"}), "avx512")
    with pytest.raises(ValueError, match="unknown CPU ISA level 'sse9'"):
        choose_level(_fake_cpu(avx2.required_cpu_flags), "sse9")


@pytest.mark.parametrize("level", all_levels(), ids=lambda level: level.name)
def test_kernel_suite_passes_at_each_level(level: IsaLevel) -> None:
    """The kernel tests again with another level's library (this process runs the best)."""
    _runnable_or_skip(level)
    if level == native.loaded_level():
        pytest.skip(f"{level.name} is this process's level: the suite ran here")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=REPO_ROOT,
        env=_child_env(level),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


_BLOCK_CODE_OUTPUTS = """
import sys, torch
from kvmesh.kernels import native
from kvmesh.kernels.block_codes import find_block_codes
from tests.kernels.test_kernels_block_codes import q4_1_weight
native.ensure_loaded()
assert native.loaded_level().name == sys.argv[2], native.loaded_level()
codes = find_block_codes(q4_1_weight(200, 256, seed=3))
outputs = {}
for rows in (1, 5, 6, 7, 16, 17):
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    outputs[rows] = torch.ops.kvmesh.block_code_linear(
        x, codes.codes, codes.scales, codes.offsets, codes.out_features
    )
# W8A8 too: portable (avx2, avx512), vpdpbusd (avx512_bf16), AMX-INT8 (amx, 16+ rows).
from tests.kernels.test_kernels_int8_linear import _codes, _run
for kind in ("q8_0", "q4_1"):
    codes = _codes(40, 160, kind, seed=8)
    for rows in (1, 9, 16, 37):
        x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
        outputs["w8a8", kind, rows] = _run(x, codes)
torch.save(outputs, sys.argv[1])
"""


def test_block_code_linear_float32_is_bitwise_equal_on_vector_levels(tmp_path: Path) -> None:
    levels = [level for level in all_levels() if level.name in VECTOR_LEVELS]
    runnable = [level for level in levels if not level.missing(CPU)]
    if len(runnable) < 2:
        pytest.skip(f"{CPU.model_name} runs fewer than two of {', '.join(VECTOR_LEVELS)}")
    outputs = {}
    for level in runnable:
        path = tmp_path / f"{level.name}.pt"
        subprocess.run(
            [sys.executable, "-c", _BLOCK_CODE_OUTPUTS, str(path), level.name],
            cwd=REPO_ROOT,
            env=_child_env(level),
            check=True,
            timeout=300,
        )
        outputs[level.name] = torch.load(path)
    first, *others = runnable
    for level in others:
        for rows, expected in outputs[first.name].items():
            assert torch.equal(outputs[level.name][rows], expected), (level.name, rows)


_BF16_BLOCK_CODE_OUTPUTS = """
import sys, torch
from kvmesh.kernels import native
from kvmesh.kernels.block_codes import find_block_codes
from tests.kernels.test_kernels_block_codes import q4_1_weight
native.ensure_loaded()
assert native.loaded_level().name == sys.argv[2], native.loaded_level()
codes = find_block_codes(q4_1_weight(200, 576, seed=5))
outputs = {}
for rows in (1, 7, 16, 33, 64, 100):
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    outputs[rows] = torch.ops.kvmesh.block_code_linear(
        x, codes.codes, codes.scales, codes.offsets, codes.out_features
    )
torch.save(outputs, sys.argv[1])
"""


def test_block_code_linear_bf16_on_amx_tiles_agrees_with_vdpbf16ps(tmp_path: Path) -> None:
    """Same bfloat16 weights and activations, float32 sums in another order:
    at most one bfloat16 rounding step apart, and rarely that."""
    levels = [level for level in all_levels() if level.name in ("avx512_bf16", "amx")]
    for level in levels:
        _runnable_or_skip(level)
    outputs = {}
    for level in levels:
        path = tmp_path / f"{level.name}.pt"
        subprocess.run(
            [sys.executable, "-c", _BF16_BLOCK_CODE_OUTPUTS, str(path), level.name],
            cwd=REPO_ROOT,
            env=_child_env(level),
            check=True,
            timeout=300,
        )
        outputs[level.name] = torch.load(path)
    for rows, dot in outputs["avx512_bf16"].items():
        tiles = outputs["amx"][rows]
        assert tiles.dtype == torch.bfloat16 and tiles.shape == dot.shape
        torch.testing.assert_close(tiles.float(), dot.float(), atol=1e-2, rtol=2**-7)
        mismatched = (tiles != dot).float().mean().item()
        assert mismatched < 0.05, f"{rows} rows: {mismatched:.1%} differ by a bf16 rounding"
