"""The step token budget a worker's hardware runs best at.

A step's token budget (``--max-num-batched-tokens``) trades the efficiency of
a step's matmuls, which grows with their rows, against how long every running
decode and every newly arrived prompt waits for that step. Where the matmuls
are already as efficient per row at 1,024 rows as at 2,048, a smaller budget
costs little and moves first tokens earlier: a burst of prompts is prefilled
in steps the first of which ends sooner, and decodes are not held behind a
1.2-1.6 s step (2,048 bf16 tokens of SmolLM2-135M on two cores).

Measured (docs/performance.md, "Step token budget"), every decoder projection of SmolLM2-135M
through oneDNN's bf16 matmul, per row:
- 2-core "AMD EPYC" family 25 model 17 (Zen 4: AVX-512, AVX512-BF16, no AMX):
  18.4, 18.5, 18.0, 17.7 us at 512, 1,024, 1,536, 2,048 rows: flat. Served
  (128/128 and 1,024/64 at concurrency 16, alternating rounds, kvmesh against
  itself), a 1,024 budget against 2,048: mean TTFT 0.64-0.81x at 0.97-1.10x
  output tok/s; 512 lost throughput (per-step costs).
- 2-core Xeon with AMX-BF16/INT8 and AVX512-BF16: 16.2, 15.0, 11.6 us at 512,
  1,024, 2,048 rows: AMX tiles want long matmuls, and a 512 budget cost
  1,024-token prompts 0.80x throughput there, so bf16 on AMX keeps 2,048.
float32 matmuls run on FMAs, not AMX tiles, so they are taken as the first
kind (not measured served). Accelerators prefill 2,048 tokens in
milliseconds: 2,048, vLLM's default.
"""

from __future__ import annotations

import torch

from kvmesh.services.runtime.cpu_features import CpuFeatures

LONG_STEP_TOKENS = 2048
SHORT_STEP_TOKENS = 1024


def preferred_step_tokens(
    device: str, dtype: torch.dtype, features: CpuFeatures | None = None
) -> int:
    """The budget for a worker computing in ``dtype`` on ``device`` (a torch
    device string); ``features`` defaults to this machine's CPU."""
    if torch.device(device).type != "cpu":
        return LONG_STEP_TOKENS
    cpu = features or CpuFeatures.detect()
    if dtype == torch.bfloat16 and cpu.amx_bf16:
        return LONG_STEP_TOKENS
    return SHORT_STEP_TOKENS
