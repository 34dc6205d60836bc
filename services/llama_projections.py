"""The linear projections of a Llama-family decoder layer, declared once.

Their names are the checkpoint's and PEFT's (``self_attn.q_proj``): the
gateway checks an adapter's ``target_modules`` against them
(services/lora_files.py), the worker reads adapter tensors by them and checks
their shapes (worker/lora), and the dense-checkpoint tool perturbs them. The
worker's model fuses some of them (q/k/v, gate/up) into one matrix; which
fused matrix holds which rows is the model file's business
(worker/models/llama.py), not this list's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The widths a projection maps between: the hidden state, all query heads,
# the key/value heads, the MLP's intermediate width.
Width = Literal["hidden", "q", "kv", "intermediate"]


@dataclass(frozen=True)
class Projection:
    """One projection of every decoder layer (``y = W x``, W of shape [out, in])."""

    # The module's name in checkpoints and PEFT adapters.
    name: str
    # The submodule that holds it: "self_attn" or "mlp".
    block: Literal["self_attn", "mlp"]
    in_width: Width
    out_width: Width
    # Tensor parallelism splits its input (each rank's partial outputs are
    # all-reduced) rather than its output rows.
    row_parallel: bool = False

    @property
    def path(self) -> str:
        """The per-layer checkpoint path, e.g. ``self_attn.q_proj``."""
        return f"{self.block}.{self.name}"


LLAMA_PROJECTIONS = (
    Projection("q_proj", "self_attn", "hidden", "q"),
    Projection("k_proj", "self_attn", "hidden", "kv"),
    Projection("v_proj", "self_attn", "hidden", "kv"),
    Projection("o_proj", "self_attn", "q", "hidden", row_parallel=True),
    Projection("gate_proj", "mlp", "hidden", "intermediate"),
    Projection("up_proj", "mlp", "hidden", "intermediate"),
    Projection("down_proj", "mlp", "intermediate", "hidden", row_parallel=True),
)
PROJECTION_NAMES = tuple(p.name for p in LLAMA_PROJECTIONS)
PROJECTIONS_BY_NAME = {p.name: p for p in LLAMA_PROJECTIONS}
