"""Typed configuration of the worker: the model it runs and its KV cache.

``ModelConfig`` holds what the worker needs from a Hugging Face ``config.json``
(read once by :meth:`ModelConfig.from_pretrained`); ``CacheConfig`` says how
large the paged KV cache is.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvmesh.kernels import kv_quant
from kvmesh.services.runtime.config import DEFAULT_MAX_MODEL_LEN, DTYPES, QUANTIZATIONS
from kvmesh.services.runtime.model_prep import gguf_weights_file, resolve_model_path
from kvmesh.worker.dtype_choice import choose_dtype

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def _rope_settings(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either config.json layout.

    transformers >= 5 writes ``rope_parameters`` (theta and scaling in one
    dict); older checkpoints write ``rope_theta`` and ``rope_scaling``.
    """
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        nested = any(isinstance(v, dict) for v in params.values())  # per layer type
        scaling = None if rope_type == "default" or nested else dict(params)
        return theta, scaling
    theta = float(hf_config.get("rope_theta", 10000.0))
    scaling = hf_config.get("rope_scaling")
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
    else:
        scaling = None
    return theta, scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _all_eos_ids(folder: Path, hf_config: dict[str, Any]) -> tuple[int, ...]:
    """config.json's EOS ids, then generation_config.json's others.

    Chat models often end a turn with a token that config.json does not name
    (Llama 3 lists <|eot_id|> and <|eom_id|> in generation_config.json only);
    every one of them must stop generation.
    """
    ids = list(_eos_ids(hf_config.get("eos_token_id")))
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        generation = json.loads(generation_file.read_text())
        ids += [i for i in _eos_ids(generation.get("eos_token_id")) if i not in ids]
    return tuple(ids)


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint folder plus the architecture facts read from its config.json."""

    path: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    # None for plain rotary embeddings, else the checkpoint's scaling dict
    # (``rope_type`` plus its parameters).
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    # Compute dtype, independent of the dtype the weights are stored in.
    dtype: torch.dtype = torch.float32
    checkpoint_dtype: torch.dtype = torch.float32
    # Why ``dtype`` (for logs and /v1/models): the flag, or auto's reasoning.
    dtype_reason: str = field(default="", compare=False)
    # Whether ``dtype`` was asked for by name (--dtype float32, not auto or the
    # default): a GGUF tensor type without a block kernel may then be
    # dequantized to dense weights instead of refused (worker/gguf_weights.py).
    dtype_explicit: bool = field(default=False, compare=False)
    # The GGUF file the weights are read from ('' : the folder's safetensors).
    gguf_file: str = ""
    # --quantization: "int8" quantizes the float projections at load, "w8a8"
    # also the activations of every codes-only projection ('' : none).
    quantization: str = ""
    # Mixture of experts: experts per layer (0: a dense MLP) and each one's width.
    num_experts: int = 0
    expert_intermediate_size: int = 0
    # The whole config.json, for the fields only one family reads (its file in
    # worker/models/ reads them, and refuses the ones it does not implement).
    hf_config: dict[str, Any] = field(default_factory=dict, hash=False, compare=False, repr=False)

    @property
    def weights_description(self) -> str:
        """How the weights are held, for logs and /v1/models: "gguf", "int8",
        "w8a8", "gguf+int8" (a GGUF's dense projections quantized too) or ""."""
        return "+".join(p for p in ("gguf" if self.gguf_file else "", self.quantization) if p)

    @property
    def load_dtype(self) -> torch.dtype:
        """The dtype weights are read into: float32 when the checkpoint has it,
        even for a narrower compute dtype, so that packing sees the exact
        weights (exact 8-bit block codes cannot be found after rounding to
        bfloat16) and rounds them once, itself; else the compute dtype."""
        return torch.float32 if self.checkpoint_dtype == torch.float32 else self.dtype

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.quantization not in ("", *QUANTIZATIONS):
            raise ValueError(
                f"unsupported quantization {self.quantization!r}; expected one of {QUANTIZATIONS}"
            )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str | torch.dtype | None = None,
        max_model_len: int | None = None,
        device: str = "cpu",
        quantization: str | None = None,
    ) -> ModelConfig:
        """Read ``path/config.json`` (``path`` may be a ``.gguf`` file: its config
        and tokenizer folder, services/runtime/model_prep.py, and its weights).

        ``dtype`` "auto" picks by the hardware (worker/dtype_choice.py); None
        means float32 on CPU (the exact-match reference path tests and
        benchmarks ask for) and the checkpoint's own dtype elsewhere.
        """
        folder = resolve_model_path(str(path))
        gguf_file = gguf_weights_file(folder)
        if (gguf_file is not None or quantization) and device != "cpu":
            raise ValueError("GGUF files and --quantization run on CPU only")
        config_file = folder / "config.json"
        if not config_file.is_file() and gguf_file is not None:
            # Writing it needs the families, which import this module: the caller
            # prepares the folder (worker/gguf_config.prepare_model_folder).
            raise FileNotFoundError(
                f"{gguf_file}: its config.json is not written yet; load it through "
                "kvmesh.worker.gguf_config.prepare_model_folder"
            )
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {folder}")
        hf_config: dict[str, Any] = json.loads(config_file.read_text())
        architectures = hf_config.get("architectures") or []
        if not architectures:
            raise ValueError(f"{config_file} names no architecture")
        checkpoint_dtype = parse_dtype(
            hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
        )
        auto = choose_dtype(dtype, device, checkpoint_dtype)
        if auto is not None:
            compute_dtype, dtype_reason = auto.dtype, auto.reason
        elif dtype is None:
            compute_dtype = torch.float32 if device == "cpu" else checkpoint_dtype
            dtype_reason = "the default of library callers"
        else:
            compute_dtype = parse_dtype(dtype)
            dtype_reason = f"--dtype {dtype}"
        num_heads = int(hf_config["num_attention_heads"])
        hidden_size = int(hf_config["hidden_size"])
        head_dim = hf_config.get("head_dim") or hidden_size // num_heads
        max_positions = int(hf_config.get("max_position_embeddings", DEFAULT_MAX_MODEL_LEN))
        if max_model_len is None:
            max_model_len = min(max_positions, DEFAULT_MAX_MODEL_LEN)
        elif max_model_len > max_positions:
            logger.warning(
                "max_model_len %s exceeds the model's max_position_embeddings %s",
                max_model_len,
                max_positions,
            )
        rope_theta, rope_scaling = _rope_settings(hf_config)
        if rope_scaling is not None:
            # LongRoPE's default factor is max_position_embeddings / original.
            rope_scaling.setdefault("max_position_embeddings", max_positions)
        config = cls(
            path=str(folder),
            architecture=str(architectures[0]),
            num_layers=int(hf_config["num_hidden_layers"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf_config["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(hf_config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            vocab_size=int(hf_config["vocab_size"]),
            max_model_len=int(max_model_len),
            eos_token_ids=_all_eos_ids(folder, hf_config),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            # Qwen2 has q/k/v biases without saying so in config.json.
            attention_bias=bool(
                hf_config.get("attention_bias", architectures[0] == "Qwen2ForCausalLM")
            ),
            dtype=compute_dtype,
            checkpoint_dtype=checkpoint_dtype,
            dtype_reason=dtype_reason,
            dtype_explicit=auto is None and dtype is not None,
            gguf_file="" if gguf_file is None else str(gguf_file),
            quantization=quantization or "",
            num_experts=int(
                hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0
            ),
            expert_intermediate_size=int(
                hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"]
            ),
            hf_config=hf_config,
        )
        # An unknown architecture or an unimplemented config feature is refused
        # by kvmesh.worker.models.registry.check_model, which the model loader and the
        # start-up paths (worker/server.py, kvmesh/llm.py) run on this config.
        return config


@dataclass(frozen=True)
class CacheConfig:
    """Size of the paged KV cache: a block count, or a memory budget to derive it from,
    and its element format (``kv_cache_dtype``: kernels/kv_quant.py)."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    # vLLM's --kv-cache-dtype: "auto" (the model dtype), int8, fp8 / fp8_e4m3, fp8_e5m2.
    kv_cache_dtype: str = kv_quant.AUTO

    def __post_init__(self) -> None:
        kv_quant.resolve(self.kv_cache_dtype)  # refuses an unknown name
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_kv_blocks is None and self.kv_cache_memory_bytes is None:
            raise ValueError("set num_kv_blocks or kv_cache_memory_bytes")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")

    @property
    def kv_format(self) -> kv_quant.KVCacheFormat | None:
        """The quantized cache format, or None for the model dtype."""
        return kv_quant.resolve(self.kv_cache_dtype)

    def bytes_per_block(self, model_config: ModelConfig, kv_head_layers: int | None = None) -> int:
        """K and V of every layer for ``block_size`` tokens; ``kv_head_layers``: KV heads
        times layers a parallel rank holds (default: the whole model's). A quantized
        cache's block counts its scales too (one float32 per token per KV head)."""
        share = kv_head_layers or model_config.num_layers * model_config.num_kv_heads
        if self.kv_format is not None:
            # Pages per KV head, as kv_quant lays them out (one head's page per layer).
            per_head = kv_quant.page_bytes(self.block_size, 1, model_config.head_dim)
            return 2 * share * per_head
        element_size = torch.empty((), dtype=model_config.dtype).element_size()
        return 2 * share * self.block_size * model_config.head_dim * element_size

    def resolve_num_kv_blocks(
        self, model_config: ModelConfig, kv_head_layers: int | None = None
    ) -> int:
        """Blocks in the budget. Every rank of a parallel replica holds the same block
        ids, so ranks pass the largest rank's share and all arrive at one count."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        assert self.kv_cache_memory_bytes is not None
        block_bytes = self.bytes_per_block(model_config, kv_head_layers)
        num_blocks = self.kv_cache_memory_bytes // block_bytes
        if num_blocks <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} is smaller than one "
                f"block ({block_bytes} bytes)"
            )
        return int(num_blocks)
