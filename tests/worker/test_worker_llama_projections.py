"""services/llama_projections.py, the one list of a Llama layer's projections, agrees
with a real checkpoint's tensors and with how the worker's model fuses them."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from services.llama_projections import LLAMA_PROJECTIONS, PROJECTION_NAMES
from services.lora_files import TARGET_MODULES
from worker.config import CacheConfig, ModelConfig
from worker.lora.setup import module_shapes
from worker.model_runner import ModelRunner

from .conftest import make_tiny_checkpoint


def test_declared_projections_are_the_checkpoints_with_their_shapes(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", torch.float32)
    tensors = load_file(next(tmp_path.glob("*.safetensors")))
    shapes = module_shapes(ModelConfig.from_pretrained(tmp_path, max_model_len=64))
    layer0 = {
        name.removeprefix("model.layers.0.").removesuffix(".weight"): tensor
        for name, tensor in tensors.items()
        if name.startswith("model.layers.0.") and "_proj." in name
    }
    assert set(layer0) == {p.path for p in LLAMA_PROJECTIONS}
    for projection in LLAMA_PROJECTIONS:
        in_features, out_features = shapes[projection.name]
        assert tuple(layer0[projection.path].shape) == (out_features, in_features)


def test_the_models_fused_slices_hold_each_projection_once(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", torch.float32)
    config = ModelConfig.from_pretrained(tmp_path, max_model_len=64)
    runner = ModelRunner(config, CacheConfig(block_size=4, num_kv_blocks=16), num_threads=1)
    shapes = module_shapes(config)
    for layer in runner.model.lora_shapes():
        slices = {
            name: (fused.in_features, rows)
            for fused in layer.values()
            for name, _, rows in fused.slices
        }
        assert sorted(slices) == sorted(PROJECTION_NAMES)
        assert slices == {name: shapes[name] for name in PROJECTION_NAMES}


def test_adapters_may_target_every_projection() -> None:
    assert TARGET_MODULES == PROJECTION_NAMES
