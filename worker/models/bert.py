"""BERT and XLM-RoBERTa encoders over packed sequences (the pooling runner's models).

An encoder sees its whole input in one step, so there is no KV cache: the
step's sequences are concatenated into one ``[num_tokens, hidden]`` batch
(no padding to the longest) and every linear layer runs once over all of
them. Attention is block-diagonal and bidirectional: each sequence attends to
itself only, computed per sequence between the packed projections
(``cu_seqlens`` marks where each one starts).

XLM-RoBERTa is BERT with two differences that matter here: positions start
after the padding index (``pad_token_id + 1``) and the classification head is
``dense -> tanh -> out_proj`` on the first token instead of BERT's pooler.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ENCODER_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "BertModel",
        "BertForSequenceClassification",
        "XLMRobertaModel",
        "XLMRobertaForSequenceClassification",
        "RobertaModel",
        "RobertaForSequenceClassification",
    }
)

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class EncoderConfig:
    """The encoder facts of a BERT-family config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    # XLM-R/RoBERTa number positions from pad_token_id + 1; BERT from 0.
    position_offset: int
    # Labels of a *ForSequenceClassification head (0: no head).
    num_labels: int
    id2label: tuple[str, ...]

    @property
    def is_roberta(self) -> bool:
        return self.architecture.startswith(("XLMRoberta", "Roberta"))

    @property
    def is_classifier(self) -> bool:
        return self.architecture.endswith("ForSequenceClassification")

    @property
    def max_input_tokens(self) -> int:
        """The longest input the position table holds."""
        return self.max_position_embeddings - self.position_offset

    def __post_init__(self) -> None:
        if self.architecture not in ENCODER_ARCHITECTURES:
            raise ValueError(f"{self.architecture!r} is not an encoder architecture")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not implemented; "
                f"supported: {sorted(_ACTIVATIONS)}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> EncoderConfig:
        architecture = str((hf_config.get("architectures") or ["BertModel"])[0])
        if hf_config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type {hf_config['position_embedding_type']!r} "
                "is not implemented (absolute only)"
            )
        roberta = architecture.startswith(("XLMRoberta", "Roberta"))
        classifier = architecture.endswith("ForSequenceClassification")
        id2label = hf_config.get("id2label") or {}
        num_labels = int(hf_config.get("num_labels") or len(id2label) or 2) if classifier else 0
        labels = tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(num_labels))
        return cls(
            architecture=architecture,
            vocab_size=int(hf_config["vocab_size"]),
            hidden_size=int(hf_config["hidden_size"]),
            num_layers=int(hf_config["num_hidden_layers"]),
            num_heads=int(hf_config["num_attention_heads"]),
            intermediate_size=int(hf_config["intermediate_size"]),
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 512)),
            type_vocab_size=int(hf_config.get("type_vocab_size", 2)),
            layer_norm_eps=float(hf_config.get("layer_norm_eps", 1e-12)),
            hidden_act=str(hf_config.get("hidden_act", "gelu")),
            position_offset=int(hf_config.get("pad_token_id", 1)) + 1 if roberta else 0,
            num_labels=num_labels,
            id2label=labels,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> EncoderConfig:
        return cls.from_hf(json.loads((Path(folder) / "config.json").read_text()))


@dataclass(frozen=True)
class PackedBatch:
    """The step's sequences concatenated: ``cu_seqlens[i]:cu_seqlens[i+1]`` is sequence i."""

    input_ids: torch.Tensor  # [num_tokens] int64
    token_type_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, from 0 within each sequence
    seq_lens: tuple[int, ...]

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return out

    @classmethod
    def pack(
        cls, sequences: list[list[int]], first_segment_lens: list[int | None] | None = None
    ) -> PackedBatch:
        """``first_segment_lens[i]``: tokens of sequence i's first segment (the rest
        get token type 1, a cross-encoder's second text); None: all type 0."""
        ids: list[int] = []
        types: list[int] = []
        positions: list[int] = []
        for i, seq in enumerate(sequences):
            ids.extend(seq)
            split = first_segment_lens[i] if first_segment_lens else None
            split = len(seq) if split is None else split
            types.extend([0] * split + [1] * (len(seq) - split))
            positions.extend(range(len(seq)))
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long),
            token_type_ids=torch.tensor(types, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            seq_lens=tuple(len(s) for s in sequences),
        )


class EncoderLayer(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = h // config.num_heads
        # q, k and v in one matmul over the packed tokens (filled by load_weights).
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.up = nn.Linear(h, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        num_tokens, hidden = x.shape
        qkv = self.qkv(x).view(num_tokens, 3, self.num_heads, self.head_dim)
        attn = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=x.dtype)
        # Block-diagonal, bidirectional: each sequence attends to itself only.
        # With a batch dimension (4-D), torch's CPU SDPA takes its flash kernel;
        # 3-D inputs fell to the math path (softmax, masks and bmm op by op):
        # 9.0 vs 5.1 ms for one 300-token sequence, one thread, Zen 2.
        for start, end in pairwise(cu_seqlens):
            q, k, v = qkv[start:end].permute(1, 2, 0, 3).unsqueeze(1)  # 3 x [1, heads, len, dim]
            attn[start:end] = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1)
        x = self.attn_norm(x + self.attn_out(attn.view(num_tokens, hidden)))
        return self.out_norm(x + self.down(self.act(self.up(x))))


class BertEncoder(nn.Module):
    """Embeddings + layers (+ the classification head of *ForSequenceClassification)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), h)
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        # BERT: pooler (dense+tanh on [CLS]) then classifier; RoBERTa: dense+tanh then out_proj.
        self.head_dense: nn.Linear | None = None
        self.head_out: nn.Linear | None = None
        if config.is_classifier:
            self.head_dense = nn.Linear(h, h)
            self.head_out = nn.Linear(h, config.num_labels)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Last hidden states of the packed tokens, ``[num_tokens, hidden]``."""
        positions = batch.positions + self.config.position_offset
        token_types = batch.token_type_ids
        if self.config.type_vocab_size <= 1:
            token_types = torch.zeros_like(token_types)  # XLM-R has one segment embedding
        x = (
            self.word_embeddings(batch.input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_types)
        )
        x = self.embed_norm(x)
        cu_seqlens = batch.cu_seqlens
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return x

    def pack(self, quantization: str = "") -> None:
        """Each layer's four projections in the decoders' inference layouts
        (worker/models/linear.py's PackedLinear: float32 panels on the blocked
        GEMM where the kernels have it, else oneDNN's packed copy; a packed
        sequence runs them on hundreds to thousands of rows, where nn.Linear's
        torch.mm was the slowest: 1.28x behind the panels on the 2-core Zen 2).
        ``--quantization`` makes them int8 codes instead (per 32 input features,
        GGUF Q8_0's layout; "w8a8" also quantizes activations). Embeddings, norms
        and the head stay as they are. Call after the weights are loaded and the
        model is in its dtype."""
        # torch kernels, on demand
        from kvmesh.worker.models.decoder import quantize_projection
        from kvmesh.worker.models.linear import PackedLinear

        dtype = self.word_embeddings.weight.dtype
        for layer in self.layers:
            for name in ("qkv", "attn_out", "up", "down"):
                linear = getattr(layer, name)
                weight, bias = linear.weight.detach(), linear.bias.detach()
                if quantization:
                    packed = quantize_projection(weight, bias, dtype, quantization)
                else:
                    packed = PackedLinear(weight, bias)
                delattr(layer, name)  # a child module: replaced by the packed callable
                setattr(layer, name, packed)

    def classify(self, first_token_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_seqs, num_labels]`` from each sequence's first-token state."""
        if self.head_dense is None or self.head_out is None:
            raise ValueError(f"{self.config.architecture} has no classification head")
        return self.head_out(torch.tanh(self.head_dense(first_token_states)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill from Hugging Face names (with or without the ``bert.``/``roberta.`` prefix)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending_qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for hf_name, tensor in weights:
            name = _our_name(hf_name)
            if name is None:
                continue
            if name.startswith("qkv:"):
                _, layer, part, kind = name.split(":")
                parts = pending_qkv.setdefault((int(layer), kind), {})
                parts[part] = tensor
                if len(parts) == 3:
                    fused = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
                    target = f"layers.{layer}.qkv.{kind}"
                    params[target].data.copy_(fused)
                    loaded.add(target)
                continue
            if name not in params:
                continue
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:8]}")


_LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "out_norm",
}
_TOP_NAMES = {
    "embeddings.word_embeddings.weight": "word_embeddings.weight",
    "embeddings.position_embeddings.weight": "position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "embed_norm.weight",
    "embeddings.LayerNorm.bias": "embed_norm.bias",
    "pooler.dense.weight": "head_dense.weight",
    "pooler.dense.bias": "head_dense.bias",
    "classifier.weight": "head_out.weight",
    "classifier.bias": "head_out.bias",
    "classifier.dense.weight": "head_dense.weight",
    "classifier.dense.bias": "head_dense.bias",
    "classifier.out_proj.weight": "head_out.weight",
    "classifier.out_proj.bias": "head_out.bias",
}


def _our_name(hf_name: str) -> str | None:
    """Our parameter name for a checkpoint name; ``qkv:<layer>:<q|k|v>:<weight|bias>``
    for the parts fused into one projection; None for tensors we do not use."""
    for prefix in ("bert.", "roberta.", "model."):
        hf_name = hf_name.removeprefix(prefix)
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    if not hf_name.startswith("encoder.layer."):
        return None  # position_ids buffers, an unused pooler of an embedding model, lm heads
    rest = hf_name.removeprefix("encoder.layer.")
    layer, _, sub = rest.partition(".")
    module, _, kind = sub.rpartition(".")
    if module.startswith("attention.self."):
        part = module.removeprefix("attention.self.")[0]  # query/key/value -> q/k/v
        return f"qkv:{layer}:{part}:{kind}"
    ours = _LAYER_NAMES.get(module)
    return None if ours is None else f"layers.{layer}.{ours}.{kind}"
