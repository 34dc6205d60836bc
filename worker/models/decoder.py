"""The decoder every family composes, over a paged KV cache.

Tokens of every request in a step arrive flattened into one ``[num_tokens]``
batch; the attention backend separates sequences using the step's metadata, so
the model has no per-request loop. A family (worker/models/<family>.py)
subclasses ``DecoderForCausalLM`` with its declaration (parameters, checkpoint
names, LoRA targets: worker/models/declaration.py) and its switches
(worker/models/features.py); q/k/v and gate/up are fused parameters whatever
the checkpoint stores.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.kernels import native
from kvmesh.kernels.backend import AttentionBackend, AttentionMetadata
from kvmesh.kernels.bf16_weights import exactly_bfloat16
from kvmesh.kernels.block_codes import RowCodes, quantize_int8
from kvmesh.kernels.ggml_blocks import GGMLRows
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.lora.slots import ProjectionShape, ProjectionSlots
from kvmesh.worker.lora.step_batch import LoRABatch
from kvmesh.worker.models.config_checks import (
    UnsupportedModelError,
    check_common,
    check_windows,
    sliding_window_of,
)
from kvmesh.worker.models.declaration import LayerKVSpec, ModelDeclaration, split_keep
from kvmesh.worker.models.features import Features, RopeSpec
from kvmesh.worker.models.ggml_linear import GGMLLinear
from kvmesh.worker.models.linear import PackedLinear
from kvmesh.worker.models.moe import is_packed, moe_experts, pack_expert_panels
from kvmesh.worker.models.quantized import (
    CODE_PIECES,
    WeightPiece,
    assemble,
    is_placeholder,
    placeholder,
    release,
)
from kvmesh.worker.models.rotary import RotaryEmbedding
from kvmesh.worker.models.row_stack import RowStack
from kvmesh.worker.parallel.sharding import ShardPlan, partition_heads

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]

# Sums a row-parallel projection's partial outputs over the TP group (in place).
AllReduce = Callable[[torch.Tensor], torch.Tensor]
# Full-vocab logits from this rank's vocab shard.
GatherVocab = Callable[[torch.Tensor, int], torch.Tensor]
# Parameters a family may leave out of its declaration (the forward skips them).
# A layer's norms (each with its fused-kernel weight: fused_norm_weight).
_NORM_PARAMS = ("input_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm", "k_norm")
_OPTIONAL_PARAMS = (
    "input_norm",
    "post_attn_norm",
    "pre_mlp_norm",
    "post_mlp_norm",
    "q_norm",
    "k_norm",
    "qkv_bias",
    "router",
    "experts_gate_up",
    "experts_down",
    "gate_up_proj",
    "down_proj",
)


def _packed_key(param: str) -> str:
    """A projection's key among the packed projections and LoRA slots ("qkv")."""
    return param.removesuffix("_proj")


def _bias_of(param: str) -> str:
    return f"{_packed_key(param)}_bias"


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def full_plan(config: ModelConfig) -> ShardPlan:
    """The plan of a model on one process: every head, row and layer."""
    return ShardPlan(
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        num_layers=config.num_layers,
        num_experts=config.num_experts,
        expert_intermediate_size=config.expert_intermediate_size,
    )


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialized: every element is overwritten by load_weights.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _projection(config: ModelConfig, rows: int, cols: int) -> nn.Parameter:
    """A projection's parameter: weightless when the checkpoint is a GGUF file
    (its codes arrive as pieces, worker/models/quantized.py), else dense."""
    if config.gguf_file:
        return placeholder(rows, cols, config.load_dtype)
    return _empty(rows, cols, dtype=config.load_dtype)


def _pack(
    weight: nn.Parameter,
    piece: WeightPiece | None,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    quantization: str,
    use_onednn: bool,
    use_block_codes: bool,
    previous: PackedLinear | None = None,
) -> PackedLinear:
    """One projection in its inference form: codes only when its checkpoint
    gave codes (``piece``) or ``quantization`` asks for them, else dense;
    "w8a8" runs codes-only projections on int8 activations (refused where the
    C++ kernels are off: there is no torch path for it).
    ``previous``: this projection packed before (packing again, e.g. to
    compare kernels), whose codes are all that is left of a quantized weight."""
    w8a8 = quantization == "w8a8"
    if w8a8 and not use_block_codes:
        raise ValueError(
            "--quantization w8a8 needs kvmesh's C++ CPU kernels (int8 dot products): "
            f"{native.unavailable_reason() or 'turned off for this model (dense linear)'}"
        )
    if piece is None and is_placeholder(weight):
        if previous is None:
            raise ValueError("a projection packed without its weights")
        if isinstance(previous, GGMLLinear):
            piece = previous.rows
        elif previous.codes_only:
            return PackedLinear.from_codes(
                previous.codes, bias, dtype, use_block_codes, use_onednn, int8_activations=w8a8
            )
        else:
            # Packed before and its parameter released: start from what it kept.
            weight.data = previous.dense_weight()
    if isinstance(piece, torch.Tensor):  # dense pieces of a placeholder
        weight.data = piece.to(weight.dtype)
    if isinstance(piece, GGMLRows):
        # A GGUF file's K-quant (or mixed) blocks: run as they are. --quantization
        # asks for codes of a dense weight, and these are codes already; w8a8
        # runs them on int8 activations (kernels/csrc/ggml_q8_linear.cpp).
        return GGMLLinear(piece, bias, dtype, use_block_codes, use_onednn, int8_activations=w8a8)
    if quantization in ("int8", "w8a8") and not isinstance(piece, RowCodes):
        piece = quantize_int8(weight)
    if isinstance(piece, RowCodes):
        release(weight)  # no-op for a placeholder; frees an int8-quantized dense weight
        return PackedLinear.from_codes(
            piece.to_panels(), bias, dtype, use_block_codes, use_onednn, int8_activations=w8a8
        )
    return PackedLinear(weight, bias, use_onednn, use_block_codes, dtype)


def quantize_projection(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, quantization: str
) -> PackedLinear:
    """A plain (float) projection packed as ``--quantization`` asks ("int8": weight-only
    codes; "w8a8": the same codes times int8 activations), computing in ``dtype``:
    the decoders' path (``_pack``) for a model outside this file (worker/models/bert.py)."""
    use_codes = native.unavailable_reason() is None and weight.device.type == "cpu"
    param = nn.Parameter(weight.detach().float().clone(), requires_grad=False)
    return _pack(param, None, bias, dtype, quantization, True, use_codes)


def share_plain_weight(param: nn.Parameter, packed: PackedLinear, keep: bool = False) -> None:
    """Point ``param`` at ``packed``'s plain weight where it keeps one
    (amx_linear's bfloat16 weight, or the torch linear's): that tensor is the
    parameter in the compute dtype, what the parameter becomes after packing
    anyway, so one copy serves both instead of two. Where it keeps none (its
    weight lives only in packed layouts: oneDNN's, the bf16 pairs, block
    codes), the parameter is released to its shape unless ``keep`` (a tied
    embedding table, which lookups read): the forward never reads it, and
    packing again starts from ``packed.dense_weight()``. A dense parameter
    beside oneDNN's copy doubled a float32 model's weight memory."""
    plain = packed.weight
    if is_placeholder(param) or (plain is None and keep):
        return
    if plain is None:
        release(param)
    elif plain.shape == param.shape:
        param.data = plain


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 like transformers, then cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def offset_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> torch.Tensor:
    """Gemma's RMSNorm: scaled by (offset + w) in float32, then cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (offset + weight.float())).to(x.dtype)


def fused_norm_weight(
    weight: torch.Tensor | None, offset: float, dtype: torch.dtype
) -> torch.Tensor | None:
    """The weight ``kvmesh::rms_norm`` (weight * (x * inv)) multiplies by to compute
    this norm, or None where it cannot: the weight itself (``rms_norm``), or
    Gemma's (offset + w) computed once in float32, with which the kernel computes
    ``offset_rms_norm``'s very products (a Gemma layer's six norms then stop
    costing six torch ops each). In bfloat16 Gemma rounds after the offset
    product, not before it as the kernel does: None."""
    if weight is None:
        return None
    if not offset:
        return weight
    if dtype != torch.float32:
        return None
    return (offset + weight.detach().float()).contiguous()


class DecoderLayer(nn.Module):
    """One decoder layer, or this TP rank's part of it: its heads, its slice of
    the MLP; ``all_reduce`` completes o_proj's and down's partial sums.

    Its parameters are the family's declaration's (worker/models/declaration.py),
    its forward the Llama layer with the family's switches (``Features``).
    """

    def __init__(
        self,
        config: ModelConfig,
        plan: ShardPlan,
        declaration: ModelDeclaration,
        features: Features,
        rope_index: int = 0,
        all_reduce: AllReduce = _identity,
        sliding_window: int | None = None,
        rotate: bool = True,
    ) -> None:
        super().__init__()
        dtype = config.dtype
        heads = plan.heads
        self.num_heads = len(heads.q_heads)
        self.num_kv_heads = len(heads.kv_heads)
        self.intermediate_size = len(plan.intermediate)
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = (
            config.head_dim**-0.5 if features.attention_scale is None else features.attention_scale
        )
        self.all_reduce = all_reduce
        self.declaration = declaration
        self.rope_index = rope_index
        # False: a NoPE layer (Features.layer_nope), whose q/k are not rotated.
        self.rotate = rotate
        # This layer's attention options (its KV-cache spec's window, the
        # family's score soft-cap), passed to the backend with every call.
        self.sliding_window = sliding_window
        self.attn_softcap = features.attn_logit_softcap
        # Projections hold the checkpoint's exact weights until pack_weights
        # (a GGUF file's codes wait beside them: _projection); vectors (norms,
        # biases) are in the compute dtype, biases in the projections' dtype.
        self.projection_names = tuple(n for n, d in declaration.params.items() if d.projection)
        for name, decl in declaration.params.items():
            shape = declaration.param_shape(name, plan, config.hidden_size)
            if decl.projection:
                param = _projection(config, *shape)
            else:
                param = _empty(*shape, dtype=config.load_dtype if "bias" in name else dtype)
            setattr(self, name, param)
        for optional in _OPTIONAL_PARAMS:
            if optional not in declaration.params:
                setattr(self, optional, None)
        self.compute_dtype = dtype
        self.quantization = config.quantization
        self._packed: dict[str, PackedLinear] | None = None
        self._native_ops = False
        # Each norm's weight for the fused kernel, by parameter name (pack_weights).
        self._fused_norms: dict[str, torch.Tensor] = {}
        # The family's switches, as plain attributes the forward reads.
        self.moe_top_k = features.moe_top_k
        self.moe_renormalize = features.moe_renormalize
        self.llama_mlp = (
            features.llama_mlp
            and self.router is None
            and self.pre_mlp_norm is not None
            and self.post_attn_norm is None
            and self.post_mlp_norm is None
        )
        self.qk_norm = features.qk_norm
        self.norm_offset = features.norm_offset
        self.gelu = features.activation == "gelu_tanh"
        self.residual_multiplier = features.residual_multiplier
        # OLMo 2's q/k norms reduce over every head; under TP a rank holds some.
        # The elements a sum over ranks covers: a KV head held by several ranks
        # (fewer KV heads than ranks) counts once per rank holding it.
        self.full_q_size = plan.num_heads * plan.head_dim
        self.full_kv_size = plan.head_dim * sum(
            len(partition_heads(plan.num_heads, plan.num_kv_heads, plan.tp_size, r).kv_heads)
            for r in range(plan.tp_size)
        )
        self.tp_size = plan.tp_size
        # Adapter slots of this layer's projections (worker/lora), when LoRA is on.
        self.lora: dict[str, ProjectionSlots] | None = None
        # What forward_row passes to its one C++ call, once packing found this
        # layer fit for it (``_pack_row_args``); None: forward only.
        self.row_args: tuple[object, ...] | None = None

    def lora_shapes(self, plan: ShardPlan, hidden_size: int) -> dict[str, ProjectionShape]:
        """Each projection's input width and the PEFT modules its output rows hold."""
        declaration = self.declaration
        by_projection: dict[str, list[tuple[str, int, int]]] = {}
        for module, target in declaration.lora_targets.items():
            first = declaration.local_offset(target.param, target.labels[0], plan, hidden_size)
            rows = sum(
                len(
                    split_keep(
                        declaration.params[target.param].part(label).split, plan, hidden_size
                    )
                )
                for label in target.labels
            )
            by_projection.setdefault(target.param, []).append((module, first, rows))
        return {
            _packed_key(param): ProjectionShape(
                getattr(self, param).shape[1], tuple(sorted(slices, key=lambda s: s[1]))
            )
            for param, slices in by_projection.items()
        }

    def pack_weights(
        self,
        use_onednn: bool,
        use_native: bool = False,
        use_block_codes: bool = False,
        pieces: dict[str, WeightPiece] | None = None,
    ) -> None:
        """Freeze the projections into inference layouts (after load_weights).

        ``use_native``: the C++ elementwise ops (kernels/csrc) are loaded and
        fit this layer's dtype (float32 or bfloat16 on CPU): fused
        RMSNorm/SwiGLU. ``use_block_codes``: small batches may run the C++
        block-code projections (any compute dtype: they take float32 rows).
        ``pieces``: a GGUF file's weights of placeholder parameters, by name.
        """
        self._native_ops = use_native
        dtype = self.compute_dtype
        fused_norms = {
            name: fused_norm_weight(getattr(self, name, None), self.norm_offset, dtype)
            for name in _NORM_PARAMS
        }
        self._fused_norms = {name: w for name, w in fused_norms.items() if w is not None}
        pieces = pieces or {}
        previous = self._packed or {}
        self._packed = {
            _packed_key(param): _pack(
                getattr(self, param),
                pieces.get(param),
                getattr(self, _bias_of(param), None),
                dtype,
                self.quantization,
                use_onednn,
                use_block_codes,
                previous.get(_packed_key(param)),
            )
            for param in self.projection_names
        }
        self.row_args = self._pack_row_args()

    def _pack_row_args(self) -> tuple[object, ...] | None:
        """The norms and the projections' blocks for ``forward_row`` when this
        layer is the plain Llama layer it computes (native ops, float32, every
        projection GGUF blocks on int8 activations without a bias, one
        process), else None."""
        packed = self._packed or {}
        plain = (
            self._native_ops
            and self.llama_mlp
            and self.compute_dtype == torch.float32
            and self.input_norm is not None
            and self.rotate
            and not self.qk_norm
            and not self.norm_offset
            and self.residual_multiplier == 1.0
            and self.tp_size == 1
            and set(packed) == {"qkv", "o", "gate_up", "down"}
        )
        if not plain or not all(
            isinstance(p, GGMLLinear) and p.takes_int8_rows for p in packed.values()
        ):
            return None
        blocks = [
            arg for name in ("qkv", "o", "gate_up", "down") for arg in packed[name].rows.kernel_args
        ]
        return (self.input_norm, self.pre_mlp_norm, self.eps, *blocks)

    def forward_row(
        self,
        hidden: torch.Tensor,
        rotary_tables: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        attention: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``forward`` of one token (no adapters) in one C++ call,
        kvmesh::ggml_llama_layer_row (kernels/csrc/ggml_q8_row.cpp): the same
        ops on the same tensors, without ~15 calls from Python per layer.
        ``attention``: the step's paged_decode_attention tables
        (``NativeCpuAttentionBackend.one_decode_row_tables``)."""
        assert self.row_args is not None
        return torch.ops.kvmesh.ggml_llama_layer_row(
            hidden,
            *self.row_args,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            *rotary_tables,
            *kv_cache,
            slot_mapping,
            *attention,
            self.scale,
            self.sliding_window or 0,
            self.attn_softcap or 0.0,
        )

    def pack_experts(self) -> None:
        """With the C++ ops (on CPU), the experts become fused_moe's panels
        (moe.pack_expert_panels): in bfloat16 words where every weight is a
        bfloat16 value (a bfloat16 checkpoint served in float32: exact, half
        the bytes a step reads), else in the weights' own dtype."""
        if self.router is None or not self._native_ops:
            return
        gate_up, down = self.experts_gate_up, self.experts_down
        if gate_up.device.type != "cpu" or is_packed(gate_up.data):
            return
        words = gate_up.dtype
        if exactly_bfloat16(gate_up.data) and exactly_bfloat16(down.data):
            words = torch.bfloat16  # exact: no value changes
        gate_up.data, down.data = pack_expert_panels(gate_up.data, down.data, words)

    def share_plain_weights(self) -> None:
        """Each projection parameter becomes its packed projection's plain
        weight where there is one, else is released (``share_plain_weight``)."""
        assert self._packed is not None
        for param in self.projection_names:
            share_plain_weight(getattr(self, param), self._packed[_packed_key(param)])

    def _linear(
        self,
        name: str,
        weight: torch.Tensor,
        x: torch.Tensor,
        lora: LoRABatch | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        y = F.linear(x, weight, bias) if self._packed is None else self._packed[name](x)
        if lora is not None and self.lora is not None:
            self.lora[name].add_delta(y, x, lora)
        return y

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The norm ``name`` (a parameter of this layer) over rows ``x`` [T, features]."""
        fused = self._fused_norms.get(name) if self._native_ops else None
        if fused is not None:
            return torch.ops.kvmesh.rms_norm(x.contiguous(), fused, self.eps)
        weight = getattr(self, name)
        if self.norm_offset:
            return offset_rms_norm(x, weight, self.eps, self.norm_offset)
        return rms_norm(x, weight, self.eps)

    def _qk_norm(self, qk: torch.Tensor, num_heads: int, name: str, full: int) -> torch.Tensor:
        """q or k [T, heads * D] normalized per head or over all heads (under TP:
        the mean of squares over every rank's heads, one small all-reduce)."""
        weight = getattr(self, name)
        if self.qk_norm == "head":
            if self._native_ops and name in self._fused_norms:
                # Every head a row of the fused norm (Qwen3, Gemma 3).
                rows = qk.reshape(-1, self.head_dim)
                return self._norm(rows, name).reshape(qk.shape)
            heads = qk.reshape(qk.shape[0], num_heads, self.head_dim)
            if self.norm_offset:
                heads = offset_rms_norm(heads, weight, self.eps, self.norm_offset)
            else:
                heads = rms_norm(heads, weight, self.eps)
            return heads.reshape(qk.shape)
        x32 = qk.float()
        squares = x32.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            squares = self.all_reduce(squares.contiguous())
        x32 = x32 * torch.rsqrt(squares / full + self.eps)
        return weight * x32.to(qk.dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        rotary_tables: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoRABatch | None = None,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``output_rows``: compute the layer's output for these rows only (its
        K/V still for every row): the last layer of a step whose other rows
        only fill the KV cache."""
        num_tokens = hidden.shape[0]
        residual = hidden
        if self.input_norm is not None:
            hidden = self._norm(hidden, "input_norm")
        qkv = self._linear("qkv", self.qkv_proj, hidden, lora, self.qkv_bias)
        if self.qk_norm:
            q_end, k_end = self.q_size, self.q_size + self.kv_size
            query_key = torch.cat(
                (
                    self._qk_norm(qkv[:, :q_end], self.num_heads, "q_norm", self.full_q_size),
                    self._qk_norm(
                        qkv[:, q_end:k_end], self.num_kv_heads, "k_norm", self.full_kv_size
                    ),
                ),
                dim=-1,
            ).view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        else:
            query_key = qkv[:, : self.q_size + self.kv_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
            )
        # Query and key heads rotate together: one set of elementwise ops per
        # layer instead of two (the same float ops, so the same results).
        if self.rotate:
            query_key = rotary.rotate(query_key, *rotary_tables)
        query = query_key[:, : self.num_heads]
        key = query_key[:, self.num_heads :]
        value = qkv[:, self.q_size + self.kv_size :].view(
            num_tokens, self.num_kv_heads, self.head_dim
        )
        k_cache, v_cache = kv_cache
        backend.write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        attn = backend.forward(
            query,
            k_cache,
            v_cache,
            metadata,
            self.scale,
            sliding_window=self.sliding_window,
            softcap=self.attn_softcap,
        )
        if output_rows is not None:
            if output_rows.shape[0] == 0:  # nothing samples: the K/V was all
                return residual[:0]
            attn, residual = attn[output_rows], residual[output_rows]
            num_tokens = attn.shape[0]
        attn_out = self.all_reduce(
            self._linear("o", self.o_proj, attn.reshape(num_tokens, self.q_size), lora)
        )

        if self.llama_mlp and self._native_ops:
            # The same float ops as below, fused into two kernels.
            hidden, residual = torch.ops.kvmesh.add_rms_norm(
                attn_out, residual, self.pre_mlp_norm, self.eps
            )
            gate_up = self._linear("gate_up", self.gate_up_proj, hidden, lora)
            return residual + self.all_reduce(
                self._linear("down", self.down_proj, torch.ops.kvmesh.silu_and_mul(gate_up), lora)
            )
        if self.post_attn_norm is not None:
            attn_out = self._norm(attn_out, "post_attn_norm")
        if self.residual_multiplier != 1.0:
            attn_out = attn_out * self.residual_multiplier
        hidden = residual + attn_out
        residual = hidden
        if self.pre_mlp_norm is not None:
            hidden = self._norm(hidden, "pre_mlp_norm")
        if self.router is not None:
            out = self.all_reduce(
                moe_experts(
                    hidden,
                    self.router,
                    self.experts_gate_up,
                    self.experts_down,
                    self.moe_top_k,
                    self.moe_renormalize,
                    self.gelu,
                )
            )
        else:
            gate_up = self._linear("gate_up", self.gate_up_proj, hidden, lora)
            if self._native_ops:
                fused = (
                    torch.ops.kvmesh.gelu_tanh_and_mul
                    if self.gelu
                    else torch.ops.kvmesh.silu_and_mul
                )
                activated = fused(gate_up.contiguous())
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                activated = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
            out = self.all_reduce(self._linear("down", self.down_proj, activated, lora))
        if self.post_mlp_norm is not None:
            out = self._norm(out, "post_mlp_norm")
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return residual + out


class DecoderForCausalLM(nn.Module):
    """Decoder stack plus LM head; ``forward`` returns hidden states, not logits.

    A family subclasses it with its ``declaration`` (parameters, checkpoint
    names, LoRA targets) and ``features`` (its forward's switches) and, where
    its config has more than Llama's fields, ``check_config``/``kv_cache_spec``
    (worker/models/llama.py is the plainest example).

    Under tensor/pipeline parallelism (``plan``) it is one rank's part: its
    stage's layers, each cut to the rank's heads and MLP slice, and on the
    first stage only, the vocab shard of the embedding and LM head plus the
    final norm (the last stage hands its hidden states back to the first, so
    sampling stays on the driver, next to the step's sampling state).
    """

    def __init__(
        self,
        config: ModelConfig,
        plan: ShardPlan | None = None,
        all_reduce: AllReduce = _identity,
        gather_vocab: GatherVocab | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.plan = plan = plan or full_plan(config)
        self.all_reduce = all_reduce
        self.gather_vocab = gather_vocab
        dtype = config.dtype
        self.layer_offset = plan.layers.start
        self.features = features = self.family_features(config)
        ropes = features.ropes or (RopeSpec(config.rope_theta, config.rope_scaling),)
        layer_rope = features.layer_rope or (0,) * config.num_layers
        layer_nope = features.layer_nope or (False,) * config.num_layers
        specs = self.kv_cache_spec(config)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                plan,
                self.declaration,
                features,
                layer_rope[i],
                all_reduce,
                specs[i].sliding_window,
                rotate=not layer_nope[i],
            )
            for i in plan.layers
        )
        self.has_head = plan.is_first_stage
        if self.has_head:
            vocab_rows = len(plan.vocab)
            # The LM head (maybe tied to the embedding) is a projection too.
            self.embed_tokens = (
                _projection(config, vocab_rows, config.hidden_size)
                if config.tie_word_embeddings or config.gguf_file
                else _empty(vocab_rows, config.hidden_size, dtype=dtype)
            )
            self.norm = _empty(config.hidden_size, dtype=dtype)
            self.lm_head = (
                self.embed_tokens
                if config.tie_word_embeddings
                else _projection(config, vocab_rows, config.hidden_size)
            )
        self._packed_lm_head: PackedLinear | None = None
        # A GGUF file's quantized embedding: rows rebuilt per lookup, no dense table.
        self._embed_codes: RowCodes | GGMLRows | None = None
        # A GGUF file's tensors for placeholder parameters, by parameter name and first row.
        self._pieces: dict[str, dict[int, WeightPiece]] = {}
        self._native_ops = False
        # The final norm's weight for the fused kernel (pack_weights; fused_norm_weight).
        self._fused_final_norm: torch.Tensor | None = None
        # Every layer in one C++ call per batch-1 decode step, when each runs
        # in one (pack_weights; worker/models/row_stack.py).
        self._row_stack: RowStack | None = None
        # One table per rotary variant (Gemma 3: global and local bases).
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(config.head_dim, config.max_model_len, r.theta, r.scaling, dtype)
            for r in ropes
        )
        self.rotary = self.rotaries[0]

    # -- what a family declares -----------------------------------------------

    declaration: ClassVar[ModelDeclaration]

    @classmethod
    def family_features(cls, config: ModelConfig) -> Features:
        """The family's switches for this checkpoint (Llama: none)."""
        return Features()

    # hidden_act values the family's MLP implements.
    activations: ClassVar[tuple[str, ...]] = ("silu",)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Refuse config.json fields this family's forward does not implement
        (worker/models/config_checks.py holds the checks every family shares);
        a family with more fields extends this."""
        check_common(config.hf_config, config.max_model_len, cls.activations)
        specs = cls.kv_cache_spec(config)
        check_windows((s.sliding_window for s in specs), "sliding_window")
        # One cache shape for every layer is what the cache allocation and the
        # kernels take (worker/kv_cache.py); a family with per-layer shapes waits.
        shapes = {(s.num_kv_heads, s.head_dim) for s in specs}
        if shapes != {(config.num_kv_heads, config.head_dim)}:
            raise UnsupportedModelError(
                f"per-layer KV-cache shapes {sorted(shapes)} differ; kvmesh's cache has one "
                f"shape for every layer ({config.num_kv_heads} KV heads x {config.head_dim})"
            )

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig) -> list[LayerKVSpec]:
        """Per layer, the KV cache it keeps (vLLM's ``get_kv_cache_spec``)."""
        window = sliding_window_of(config.hf_config)
        return [
            LayerKVSpec(config.num_kv_heads, config.head_dim, window)
            for _ in range(config.num_layers)
        ]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],  # one (k_cache, v_cache) per layer
        metadata: AttentionMetadata | Sequence[AttentionMetadata],
        backend: AttentionBackend,
        hidden: torch.Tensor | None = None,
        lora: LoRABatch | None = None,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] before the final norm; a later
        pipeline stage passes the previous stage's ``hidden`` instead of embedding.

        ``lora``: the step's adapter layout (worker/lora); None runs the base model.
        ``output_rows``: return the hidden states of these rows only
        ([len(output_rows), hidden_size]). A prompt chunk's other rows need the
        last layer's K/V but not its attention output, O projection or MLP,
        which the last layer then skips (for a 1,024-token chunk of the
        30-layer default model, ~2.8% of the step's projection FLOPs).
        """
        if hidden is None:
            hidden = self._embed(input_ids)
        rotaries = self.rotaries
        tables = [rotary.tables(positions) for rotary in rotaries]
        last = len(self.layers) - 1
        # One metadata for every layer, or (several KV-cache groups) one per
        # layer: its group's block tables and slots.
        per_layer = None if isinstance(metadata, AttentionMetadata) else metadata
        row_attention = self._row_attention(hidden, metadata, backend, kv_caches)
        stack = self._row_stack
        if (
            row_attention is not None
            and stack is not None
            and lora is None
            and output_rows is None
            and stack.current(self.layers)  # type: ignore[arg-type]
        ):
            # Every layer's forward_row below, in one call.
            return stack.forward(
                hidden,
                tables,
                kv_caches,
                metadata.slot_mapping,  # type: ignore[union-attr]
                row_attention,
            )
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if (
                row_attention is not None
                and layer.row_args is not None
                and (lora is None or layer.lora is None)
                and (output_rows is None or index != last)
            ):
                hidden = layer.forward_row(
                    hidden,
                    tables[layer.rope_index],
                    kv_cache,
                    metadata.slot_mapping,  # type: ignore[union-attr]
                    row_attention,
                )
                continue
            hidden = layer(
                hidden,
                rotaries[layer.rope_index],
                tables[layer.rope_index],
                kv_cache,
                metadata if per_layer is None else per_layer[index],
                backend,
                lora,
                output_rows if index == last else None,
            )
        return hidden

    @staticmethod
    def _row_attention(
        hidden: torch.Tensor,
        metadata: AttentionMetadata | Sequence[AttentionMetadata],
        backend: AttentionBackend,
        kv_caches: list[KVCache],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The attention tables of a step that is one decode token the layers may
        run in one C++ call each (``DecoderLayer.forward_row``), else None."""
        if hidden.shape[0] != 1 or not isinstance(metadata, AttentionMetadata) or not kv_caches:
            return None
        tables = getattr(backend, "one_decode_row_tables", None)
        return None if tables is None else tables(metadata, *kv_caches[0], hidden.dtype)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self._embed_codes is None:
            return F.embedding(ids, self.embed_tokens)
        return self._embed_codes.embedding(ids).to(self.config.dtype)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self._embed_rows(input_ids)
        scale = self.features.embed_scale
        # Gemma scales by sqrt(hidden) rounded to the compute dtype, as transformers does.
        return hidden if scale == 1.0 else hidden * torch.tensor(scale, dtype=hidden.dtype)

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.plan.tp_size == 1:
            return self._lookup(input_ids)
        # Vocab-parallel: each rank looks up the ids in its shard, zeros the rest;
        # the sum over ranks is the full lookup (exact: one non-zero term per row).
        vocab = self.plan.vocab
        local = input_ids - vocab.start
        outside = (local < 0) | (local >= len(vocab))
        hidden = self._lookup(local.clamp(0, len(vocab) - 1))
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.all_reduce(hidden)

    def lora_shapes(self) -> list[dict[str, ProjectionShape]]:
        """Per layer, the projections adapters apply to (worker/lora/slots.py)."""
        return [layer.lora_shapes(self.plan, self.config.hidden_size) for layer in self.layers]

    def attach_lora(self, layer_slots: list[dict[str, ProjectionSlots]]) -> None:
        for layer, slots in zip(self.layers, layer_slots, strict=True):
            layer.lora = slots

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's last norm over the given rows: transformers' last_hidden_state
        (what a pooling runner pools) and the LM head's input."""
        fused = self._fused_final_norm if self._native_ops else None
        if fused is not None:
            return torch.ops.kvmesh.rms_norm(hidden.contiguous(), fused, self.config.rms_norm_eps)
        if self.features.norm_offset:
            return offset_rms_norm(
                hidden, self.norm, self.config.rms_norm_eps, self.features.norm_offset
            )
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for the given rows only (the rows that sample); norm is per row."""
        return self.lm_head_logits(self.final_norm(hidden))

    def lm_head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits of rows already through ``final_norm``."""
        features = self.features
        if self._packed_lm_head is None:
            logits = F.linear(normed, self.lm_head)
        else:
            logits = self._packed_lm_head(normed)
        logits = logits.float()  # sampling is float32 whatever the compute dtype
        if self.gather_vocab is not None:
            logits = self.gather_vocab(logits, self.config.vocab_size)
        if features.logits_divisor != 1.0:
            logits = logits / features.logits_divisor
        if features.final_logit_softcap is not None:
            cap = features.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def pack_weights(self, use_onednn: bool = True, use_native: bool = True) -> None:
        """Prepare every projection for inference once the weights are loaded.

        ``use_native`` asks for kvmesh's C++ CPU ops; they are used where they
        load and fit, decided here once for every layer: the elementwise ops for
        float32 and bfloat16 on CPU, block-code projections in either (found on
        the weights as loaded, ModelConfig.load_dtype, before any rounding).
        Projections are packed to compute in the model's dtype.
        """
        use_codes = (
            use_native
            and self.rotary.cos.device.type == "cpu"
            and native.unavailable_reason() is None
        )
        self._native_ops = use_codes and self.config.dtype in native.NATIVE_DTYPES
        self._fused_final_norm = fused_norm_weight(
            getattr(self, "norm", None), self.features.norm_offset, self.config.dtype
        )
        params = dict(self.named_parameters())
        pieces = {
            name: assemble(rows, params[name].shape[0]) for name, rows in self._pieces.items()
        }
        self._pieces = {}  # now held by the packed projections (and _embed_codes)
        for index, layer in enumerate(self.layers):
            prefix = f"layers.{index}."
            layer_pieces = {
                name.removeprefix(prefix): piece
                for name, piece in pieces.items()
                if name.startswith(prefix)
            }
            layer.pack_weights(use_onednn, self._native_ops, use_codes, layer_pieces)
            # Layer by layer: a packed layer's parameters are gone before the next packs.
            layer.share_plain_weights()
        self._row_stack = RowStack.of(list(self.layers))  # type: ignore[arg-type]
        for rotary in self.rotaries:
            rotary.use_native = self._native_ops
        if self.has_head:
            self._pack_head(pieces, use_onednn, use_codes)
        if self.has_head and self._packed_lm_head is not None:
            # Tied, the LM head is the embedding table, which lookups read.
            tied = self.lm_head is self.embed_tokens
            share_plain_weight(self.lm_head, self._packed_lm_head, keep=tied)
        # Packed from the exact weights; every parameter now rounds to the
        # compute dtype once (the embedding, the unpacked fallbacks).
        for param in self.parameters():
            if param.dtype != self.config.dtype:
                if is_placeholder(param):
                    param.data = placeholder(*param.shape, self.config.dtype).data
                else:
                    param.data = param.data.to(self.config.dtype)
        for layer in self.layers:
            layer.pack_experts()

    def _pack_head(self, pieces: dict[str, WeightPiece], use_onednn: bool, use_codes: bool) -> None:
        """The embedding table and LM head: a GGUF file's codes stay codes (the
        lookup rebuilds rows, the head runs like any projection); dense pieces
        fill their parameters. --quantization leaves both as they are (but for
        a head of K-quant blocks under w8a8)."""
        embed = pieces.get("embed_tokens")
        if isinstance(embed, CODE_PIECES):
            self._embed_codes = embed
        elif embed is not None:
            self.embed_tokens.data = embed.to(self.embed_tokens.dtype)
        head = embed if self.config.tie_word_embeddings else pieces.get("lm_head")
        # A GGUF head kept as K-quant blocks takes int8 activations under w8a8,
        # as llama.cpp's does: it is the largest weight a decode step reads.
        w8a8_head = isinstance(head, GGMLRows) and self.config.quantization == "w8a8"
        self._packed_lm_head = _pack(
            self.lm_head,
            head,
            None,
            self.config.dtype,
            "w8a8" if w8a8_head else "",
            use_onednn,
            use_codes,
            self._packed_lm_head,
        )

    @property
    def uses_native_ops(self) -> bool:
        """Whether the forward runs kvmesh's C++ CPU ops (so they are loaded)."""
        return self._native_ops

    def set_native_elementwise(self, enabled: bool) -> None:
        """Switch the fused C++ RMSNorm/SwiGLU/rotary ops on or off after packing,
        leaving the projections as packed: an A/B of those ops alone."""
        self._native_ops = enabled
        for layer in self.layers:
            layer._native_ops = enabled
        for rotary in self.rotaries:
            rotary.use_native = enabled

    def _all_packed(self) -> list[PackedLinear]:
        packed = [self._packed_lm_head] if self.has_head and self._packed_lm_head else []
        return packed + [p for layer in self.layers for p in (layer._packed or {}).values()]

    def block_code_coverage(self) -> tuple[int, int]:
        """(projections running on exact block codes for small batches, all projections)."""
        packed = self._all_packed()
        return sum(p.uses_block_codes for p in packed), len(packed)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights resident after packing: the projections' (codes, packed
        and dense copies), the embedding's codes, every parameter's own storage
        (one that is a projection's plain weight counts with the projections)."""
        # A parameter sharing its packed projection's plain weight is counted there.
        shared = {
            p.weight.untyped_storage().data_ptr()
            for p in self._all_packed()
            if p.weight is not None
        }
        params = sum(
            p.untyped_storage().nbytes()
            for p in {id(p): p for p in self.parameters()}.values()
            if p.untyped_storage().data_ptr() not in shared
        )
        return {
            "projections": sum(p.resident_bytes for p in self._all_packed()),
            "codes_only_projections": sum(p.codes_only for p in self._all_packed()),
            "embedding_codes": self._embedding_code_bytes(),
            "parameters": params,
        }

    def _embedding_code_bytes(self) -> int:
        """The embedding's codes, unless the tied LM head holds the same blocks
        (GGMLRows: one copy serves both, counted with the projections)."""
        head = self._packed_lm_head if self.has_head else None
        if self._embed_codes is None:
            return 0
        if isinstance(head, GGMLLinear) and head.rows is self._embed_codes:
            return 0
        return self._embed_codes.nbytes

    def resident_weight_bytes(self) -> int:
        """All bytes of weights this model keeps (``weight_bytes``' byte counts)."""
        sizes = self.weight_bytes()
        return sizes["projections"] + sizes["embedding_codes"] + sizes["parameters"]

    # -- loading -------------------------------------------------------------

    def _global_target(self, name: str) -> torch.Tensor | None:
        """The parameter a non-layer checkpoint tensor fills (None: skip it)."""
        declaration = self.declaration
        if name == declaration.embed_name:
            return self.embed_tokens
        if name == declaration.norm_name:
            return self.norm
        if name == declaration.lm_head_name:
            # Some tied checkpoints store the copy anyway.
            return None if self.config.tie_word_embeddings else self.lm_head
        raise ValueError(f"unexpected weight {name!r} in checkpoint")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, WeightPiece]]) -> None:
        """Copy checkpoint tensors into the (fused) parameters, this rank's part of
        each as the family's declaration says; fail on anything missing."""
        declaration, plan, hidden_size = self.declaration, self.plan, self.config.hidden_size
        params = dict(self.named_parameters())
        names_by_param = {id(p): name for name, p in params.items()}
        rows_loaded: dict[str, int] = {}
        prefix = declaration.layer_prefix
        for name, tensor in weights:
            if name.endswith(declaration.ignored_suffixes):
                continue
            if not name.startswith(prefix):
                if not self.has_head:
                    continue  # a later pipeline stage: layers only
                target = self._global_target(name)
                if target is None:
                    continue
                param_name, row = names_by_param[id(target)], 0
                if name != declaration.norm_name and plan.tp_size > 1:
                    vocab = plan.vocab
                    tensor = tensor[vocab.start : vocab.stop]
            else:
                index, _, suffix = name[len(prefix) :].partition(".")
                found = declaration.layer_tensor(suffix)
                if not index.isdigit() or int(index) >= self.config.num_layers or found is None:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                if int(index) not in plan.layers:
                    continue  # another pipeline stage's layer
                checkpoint, expert = found
                local = int(index) - self.layer_offset
                target = getattr(self.layers[local], checkpoint.param)
                param_name = f"layers.{local}.{checkpoint.param}"
                if expert is not None:
                    if expert >= target.shape[0]:
                        raise ValueError(f"unexpected weight {name!r} in checkpoint")
                    target = target[expert]
                row = declaration.local_offset(
                    checkpoint.param, checkpoint.labels[0], plan, hidden_size
                )
                tensor = declaration.shard_layer_tensor(suffix, tensor, plan, hidden_size)
            if tensor.shape[1:] != target.shape[1:] or row + tensor.shape[0] > target.shape[0]:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, does not fit "
                    f"{tuple(target.shape)} at row {row}"
                )
            if is_placeholder(target):
                self._pieces.setdefault(param_name, {})[row] = tensor  # packed later
            else:
                if isinstance(tensor, CODE_PIECES):
                    tensor = tensor.dequantize()
                target[row : row + tensor.shape[0]].copy_(tensor)
            # Elements, not rows: an expert's matrix fills one slice of its stack.
            rows_loaded[param_name] = rows_loaded.get(param_name, 0) + math.prod(tensor.shape)
        missing = sorted(
            name for name, param in params.items() if rows_loaded.get(name, 0) != param.numel()
        )
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:8]}")
