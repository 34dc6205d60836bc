"""Load a Hugging Face checkpoint folder into one of our model classes.

A folder holds ``config.json`` and either one ``model.safetensors`` or several
shards listed by ``model.safetensors.index.json``. Weights are cast to the
model's load dtype as they are read (ModelConfig.load_dtype), so a bfloat16
checkpoint runs in float32 on CPU, and a float32 one packs its projections for
bfloat16 from the exact float32 weights. A ``.gguf`` checkpoint
(ModelConfig.gguf_file) is read from that file instead: its quantized tensors
stay codes (worker/gguf_weights.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kvmesh.services.runtime.config.process import DENSE_LINEAR
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.gguf_weights import GGUFTensor, iterate_gguf_weights
from kvmesh.worker.models.config_checks import UnsupportedModelError
from kvmesh.worker.models.decoder import AllReduce, DecoderForCausalLM, GatherVocab
from kvmesh.worker.models.registry import check_model
from kvmesh.worker.parallel.sharding import ShardPlan

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order."""
    index_file = folder / SAFETENSORS_INDEX
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_file} lists shards that are missing: {missing}")
        return files
    single = folder / SAFETENSORS_SINGLE
    if single.is_file():
        return [single]
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        return shards
    raise FileNotFoundError(
        f"no safetensors weights in {folder} (expected {SAFETENSORS_SINGLE} or "
        f"{SAFETENSORS_INDEX}); .bin/.pt checkpoints are not supported"
    )


def iterate_weights(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor in ``dtype``) for every tensor of every shard."""
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = shard.get_tensor(name)
                if tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor


def model_weights(model_config: ModelConfig) -> Iterator[tuple[str, GGUFTensor]]:
    """The checkpoint's tensors: its GGUF file's (codes kept), else its safetensors'."""
    if model_config.gguf_file:
        return iterate_gguf_weights(
            Path(model_config.gguf_file),
            check_model(model_config).declaration,
            model_config.num_heads,
            model_config.num_kv_heads,
            model_config.load_dtype,
            allow_dense=model_config.dtype_explicit,
            int8_activations=model_config.quantization == "w8a8",
        )
    return iterate_weights(Path(model_config.path), model_config.load_dtype)


def load_model(
    model_config: ModelConfig,
    device: str | torch.device = "cpu",
    plan: ShardPlan | None = None,
    all_reduce: AllReduce | None = None,
    gather_vocab: GatherVocab | None = None,
) -> DecoderForCausalLM:
    """Build the model class for the checkpoint's architecture and fill its weights
    (this rank's shards of them under tensor/pipeline parallelism: ``plan``)."""
    model_class = check_model(model_config)
    if torch.device(device).type != "cpu" and "router" in model_class.declaration.params:
        # torch._grouped_mm's GPU kernels take bfloat16 on recent GPUs only, and
        # no test has run the expert path on one: refused, not guessed.
        raise UnsupportedModelError(
            f"{model_config.architecture} (mixture of experts) runs on CPU only in kvmesh"
        )
    parallel_args = {} if all_reduce is None else {"all_reduce": all_reduce}
    model = model_class(model_config, plan, gather_vocab=gather_vocab, **parallel_args).to(device)
    model.load_weights(model_weights(model_config))
    model.eval()
    dense = DENSE_LINEAR.get()  # plain F.linear, e.g. to compare kernels
    model.pack_weights(use_onednn=not dense, use_native=not dense)
    with_codes, total = model.block_code_coverage()
    logger.info(
        "%d of %d projections run small batches on exact 8-bit block codes", with_codes, total
    )
    sizes = model.weight_bytes()
    logger.info(
        "weights resident: %.1f MB of projections (%d kept only as codes), %.1f MB of "
        "embedding codes, %.1f MB of parameters",
        sizes["projections"] / 1e6,
        sizes["codes_only_projections"],
        sizes["embedding_codes"] / 1e6,
        sizes["parameters"] / 1e6,
    )
    logger.info(
        "resident weight bytes: %d (%.1f MB)",
        model.resident_weight_bytes(),
        model.resident_weight_bytes() / 1e6,
    )
    logger.info(
        "loaded %s from %s (%s layers, dtype %s%s)",
        model_config.architecture,
        model_config.gguf_file or model_config.path,
        model_config.num_layers,
        model_config.dtype,
        f", weights {model_config.weights_description}" if model_config.weights_description else "",
    )
    return model
