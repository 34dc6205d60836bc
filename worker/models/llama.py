"""The Llama family (Llama, Mistral, Qwen2) over a paged KV cache.

Tokens of every request in a step arrive flattened into one ``[num_tokens]``
batch; the attention backend separates sequences using the step's metadata, so
the model has no per-request loop. q/k/v and gate/up projections are fused into
single matmuls when the weights are loaded.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native
from kernels.backend import AttentionBackend, AttentionMetadata
from worker.config import ModelConfig
from worker.lora.slots import ProjectionShape, ProjectionSlots
from worker.lora.step_batch import LoRABatch
from worker.models.linear import PackedLinear
from worker.models.rotary import RotaryEmbedding
from worker.parallel.sharding import ShardPlan

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]

_LAYER_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Sums a row-parallel projection's partial outputs over the TP group (in place).
AllReduce = Callable[[torch.Tensor], torch.Tensor]
# Full-vocab logits from this rank's vocab shard.
GatherVocab = Callable[[torch.Tensor, int], torch.Tensor]


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
    )


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialized: every element is overwritten by load_weights.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 like transformers, then cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaDecoderLayer(nn.Module):
    """One decoder layer, or this TP rank's part of it: its heads, its slice of
    the MLP; ``all_reduce`` completes o_proj's and down's partial sums."""

    def __init__(
        self, config: ModelConfig, plan: ShardPlan, all_reduce: AllReduce = _identity
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
        self.scale = config.head_dim**-0.5
        self.all_reduce = all_reduce
        self.input_norm = _empty(config.hidden_size, dtype=dtype)
        self.post_attention_norm = _empty(config.hidden_size, dtype=dtype)
        # Projections hold the checkpoint's exact weights until pack_weights.
        proj = config.load_dtype
        self.qkv_proj = _empty(self.q_size + 2 * self.kv_size, config.hidden_size, dtype=proj)
        self.qkv_bias = (
            _empty(self.q_size + 2 * self.kv_size, dtype=proj) if config.attention_bias else None
        )
        self.o_proj = _empty(config.hidden_size, self.q_size, dtype=proj)
        self.gate_up_proj = _empty(2 * self.intermediate_size, config.hidden_size, dtype=proj)
        self.down_proj = _empty(config.hidden_size, self.intermediate_size, dtype=proj)
        self._packed: dict[str, PackedLinear] | None = None
        self._native_ops = False
        # Adapter slots of this layer's projections (worker/lora), when LoRA is on.
        self.lora: dict[str, ProjectionSlots] | None = None

    def lora_shapes(self, intermediate_size: int) -> dict[str, ProjectionShape]:
        """Each fused projection's input width and the PEFT modules its output rows hold."""
        q, kv, hidden = self.q_size, self.kv_size, self.o_proj.shape[0]
        return {
            "qkv": ProjectionShape(
                hidden, (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv))
            ),
            "o": ProjectionShape(q, (("o_proj", 0, hidden),)),
            "gate_up": ProjectionShape(
                hidden,
                (
                    ("gate_proj", 0, intermediate_size),
                    ("up_proj", intermediate_size, intermediate_size),
                ),
            ),
            "down": ProjectionShape(intermediate_size, (("down_proj", 0, hidden),)),
        }

    def pack_weights(
        self, use_onednn: bool, use_native: bool = False, use_block_codes: bool = False
    ) -> None:
        """Freeze the projections into inference layouts (after load_weights).

        ``use_native``: the C++ elementwise ops (kernels/csrc) are loaded and
        fit this layer's dtype (float32 or bfloat16 on CPU): fused
        RMSNorm/SwiGLU. ``use_block_codes``: small batches may run the C++
        block-code projections (any compute dtype: they take float32 rows).
        """
        self._native_ops = use_native
        dtype = self.input_norm.dtype
        self._packed = {
            name: PackedLinear(weight, bias, use_onednn, use_block_codes, dtype)
            for name, weight, bias in (
                ("qkv", self.qkv_proj, self.qkv_bias),
                ("o", self.o_proj, None),
                ("gate_up", self.gate_up_proj, None),
                ("down", self.down_proj, None),
            )
        }

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

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        rotary_tables: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        residual = hidden
        if self._native_ops:
            hidden = torch.ops.kvmesh.rms_norm(hidden, self.input_norm, self.eps)
        else:
            hidden = rms_norm(hidden, self.input_norm, self.eps)
        qkv = self._linear("qkv", self.qkv_proj, hidden, lora, self.qkv_bias)
        # Query and key heads rotate together: one set of elementwise ops per
        # layer instead of two (the same float ops, so the same results).
        query_key = qkv[:, : self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )
        query_key = rotary.rotate(query_key, *rotary_tables)
        query = query_key[:, : self.num_heads]
        key = query_key[:, self.num_heads :]
        value = qkv[:, self.q_size + self.kv_size :].view(
            num_tokens, self.num_kv_heads, self.head_dim
        )
        k_cache, v_cache = kv_cache
        backend.write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        attn = backend.forward(query, k_cache, v_cache, metadata, self.scale)
        attn_out = self.all_reduce(
            self._linear("o", self.o_proj, attn.reshape(num_tokens, self.q_size), lora)
        )

        if self._native_ops:
            # The same float ops as below, fused into two kernels.
            hidden, residual = torch.ops.kvmesh.add_rms_norm(
                attn_out, residual, self.post_attention_norm, self.eps
            )
            gate_up = self._linear("gate_up", self.gate_up_proj, hidden, lora)
            return residual + self.all_reduce(
                self._linear("down", self.down_proj, torch.ops.kvmesh.silu_and_mul(gate_up), lora)
            )
        hidden = residual + attn_out
        residual = hidden
        hidden = rms_norm(hidden, self.post_attention_norm, self.eps)
        gate, up = self._linear("gate_up", self.gate_up_proj, hidden, lora).chunk(2, dim=-1)
        return residual + self.all_reduce(
            self._linear("down", self.down_proj, F.silu(gate) * up, lora)
        )


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head; ``forward`` returns hidden states, not logits.

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
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, plan, all_reduce) for _ in plan.layers
        )
        self.has_head = plan.is_first_stage
        if self.has_head:
            vocab_rows = len(plan.vocab)
            # The LM head (maybe tied to the embedding) is a projection too.
            head_dtype = config.load_dtype
            self.embed_tokens = _empty(
                vocab_rows,
                config.hidden_size,
                dtype=head_dtype if config.tie_word_embeddings else dtype,
            )
            self.norm = _empty(config.hidden_size, dtype=dtype)
            self.lm_head = (
                self.embed_tokens
                if config.tie_word_embeddings
                else _empty(vocab_rows, config.hidden_size, dtype=head_dtype)
            )
        self._packed_lm_head: PackedLinear | None = None
        self._native_ops = False
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_model_len,
            config.rope_theta,
            config.rope_scaling,
            dtype,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],  # one (k_cache, v_cache) per layer
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        hidden: torch.Tensor | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] before the final norm; a later
        pipeline stage passes the previous stage's ``hidden`` instead of embedding.

        ``lora``: the step's adapter layout (worker/lora); None runs the base model.
        """
        if hidden is None:
            hidden = self._embed(input_ids)
        rotary_tables = self.rotary.tables(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, self.rotary, rotary_tables, kv_cache, metadata, backend, lora)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.plan.tp_size == 1:
            return F.embedding(input_ids, self.embed_tokens)
        # Vocab-parallel: each rank looks up the ids in its shard, zeros the rest;
        # the sum over ranks is the full lookup (exact: one non-zero term per row).
        vocab = self.plan.vocab
        local = input_ids - vocab.start
        outside = (local < 0) | (local >= len(vocab))
        hidden = F.embedding(local.clamp(0, len(vocab) - 1), self.embed_tokens)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.all_reduce(hidden)

    def lora_shapes(self) -> list[dict[str, ProjectionShape]]:
        """Per layer, the projections adapters apply to (worker/lora/slots.py)."""
        return [layer.lora_shapes(self.config.intermediate_size) for layer in self.layers]

    def attach_lora(self, layer_slots: list[dict[str, ProjectionSlots]]) -> None:
        for layer, slots in zip(self.layers, layer_slots, strict=True):
            layer.lora = slots

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for the given rows only (the rows that sample); norm is per row."""
        if self._native_ops:
            normed = torch.ops.kvmesh.rms_norm(
                hidden.contiguous(), self.norm, self.config.rms_norm_eps
            )
        else:
            normed = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        if self._packed_lm_head is None:
            logits = F.linear(normed, self.lm_head)
        else:
            logits = self._packed_lm_head(normed)
        logits = logits.float()  # sampling is float32 whatever the compute dtype
        if self.gather_vocab is None:
            return logits
        return self.gather_vocab(logits, self.config.vocab_size)

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
        for layer in self.layers:
            layer.pack_weights(use_onednn, self._native_ops, use_codes)
        self.rotary.use_native = self._native_ops
        if self.has_head:
            self._packed_lm_head = PackedLinear(
                self.lm_head, None, use_onednn, use_codes, self.config.dtype
            )
        # Packed from the exact weights; every parameter now rounds to the
        # compute dtype once (the embedding, the unpacked fallbacks).
        for param in self.parameters():
            if param.dtype != self.config.dtype:
                param.data = param.data.to(self.config.dtype)

    def set_native_elementwise(self, enabled: bool) -> None:
        """Switch the fused C++ RMSNorm/SwiGLU/rotary ops on or off after packing,
        leaving the projections as packed: an A/B of those ops alone."""
        self._native_ops = enabled
        for layer in self.layers:
            layer._native_ops = enabled
        self.rotary.use_native = enabled

    def block_code_coverage(self) -> tuple[int, int]:
        """(projections running on exact block codes for small batches, all projections)."""
        packed = [self._packed_lm_head] if self.has_head else []
        packed += [p for layer in self.layers for p in (layer._packed or {}).values()]
        return sum(p is not None and p.uses_block_codes for p in packed), len(packed)

    # -- loading -------------------------------------------------------------

    def _layer_target(self, layer: LlamaDecoderLayer, name: str) -> tuple[torch.Tensor, int]:
        """(destination parameter, first row) for one per-layer checkpoint tensor."""
        q, kv, inter = layer.q_size, layer.kv_size, layer.intermediate_size
        targets: dict[str, tuple[torch.Tensor | None, int]] = {
            "input_layernorm.weight": (layer.input_norm, 0),
            "post_attention_layernorm.weight": (layer.post_attention_norm, 0),
            "self_attn.q_proj.weight": (layer.qkv_proj, 0),
            "self_attn.k_proj.weight": (layer.qkv_proj, q),
            "self_attn.v_proj.weight": (layer.qkv_proj, q + kv),
            "self_attn.q_proj.bias": (layer.qkv_bias, 0),
            "self_attn.k_proj.bias": (layer.qkv_bias, q),
            "self_attn.v_proj.bias": (layer.qkv_bias, q + kv),
            "self_attn.o_proj.weight": (layer.o_proj, 0),
            "mlp.gate_proj.weight": (layer.gate_up_proj, 0),
            "mlp.up_proj.weight": (layer.gate_up_proj, inter),
            "mlp.down_proj.weight": (layer.down_proj, 0),
        }
        target, row = targets.get(name, (None, 0))
        if target is None:
            raise KeyError(name)
        return target, row

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the (fused) parameters; fail on anything missing."""
        params = dict(self.named_parameters())
        names_by_param = {id(p): name for name, p in params.items()}
        rows_loaded: dict[str, int] = {}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if not self.has_head and not name.startswith("model.layers."):
                continue  # a later pipeline stage: layers only
            if name == "model.embed_tokens.weight":
                target, row = self.embed_tokens, 0
            elif name == "model.norm.weight":
                target, row = self.norm, 0
            elif name == "lm_head.weight":
                if self.config.tie_word_embeddings:
                    continue  # some tied checkpoints store the copy anyway
                target, row = self.lm_head, 0
            else:
                match = _LAYER_WEIGHT.fullmatch(name)
                if match is None or int(match.group(1)) >= self.config.num_layers:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                if int(match.group(1)) not in self.plan.layers:
                    continue  # another pipeline stage's layer
                try:
                    target, row = self._layer_target(
                        self.layers[int(match.group(1)) - self.layer_offset], match.group(2)
                    )
                except KeyError:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint") from None
                tensor = self.plan.shard(match.group(2), tensor)
            if not name.startswith("model.layers."):
                tensor = self.plan.shard(name, tensor)
            if tensor.shape[1:] != target.shape[1:] or row + tensor.shape[0] > target.shape[0]:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, does not fit "
                    f"{tuple(target.shape)} at row {row}"
                )
            target[row : row + tensor.shape[0]].copy_(tensor)
            param_name = names_by_param[id(target)]
            rows_loaded[param_name] = rows_loaded.get(param_name, 0) + tensor.shape[0]
        missing = sorted(
            name for name, param in params.items() if rows_loaded.get(name, 0) != param.shape[0]
        )
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:8]}")
