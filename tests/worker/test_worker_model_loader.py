"""Checkpoint loading: dtypes, shards, tied embeddings, Qwen2 biases, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.contracts.step import NewRequestData
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_loader import load_model
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.step_inputs import prepare_step_inputs

from .conftest import hf_greedy_tokens, make_tiny_checkpoint

PROMPTS = [[3, 17, 42, 99, 5], [7] * 3 + list(range(20, 60)), [11, 12]]
NEW_TOKENS = 12


def _runner(folder: Path) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(folder),
        CacheConfig(block_size=4, num_kv_blocks=64),
        num_threads=1,
    )


def _greedy(runner: ModelRunner) -> list[list[int]]:
    driver = LocalDriver(runner)
    for index, prompt in enumerate(PROMPTS):
        driver.add_request(f"r{index}", prompt, SamplingParams(temperature=0.0), NEW_TOKENS)
    finished = driver.run()
    return [finished[f"r{i}"].output_token_ids for i in range(len(PROMPTS))]


def _hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0]


def _our_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position (the runner itself only computes sampling rows)."""
    batch = runner.input_batch
    num_blocks = cdiv(len(prompt), runner.cache_config.block_size)
    batch.add_request(
        NewRequestData("logits", prompt, [], SamplingParams(), list(range(num_blocks)), 0)
    )
    rows = np.array([batch.row_of["logits"]])
    inputs = prepare_step_inputs(
        batch, rows, np.array([len(prompt)]), runner.backend, runner.device
    )
    with torch.inference_mode():
        hidden = runner.model(
            inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metadata, runner.backend
        )
        logits = runner.model.compute_logits(hidden)
    batch.remove_request("logits")
    return logits


def test_bfloat16_checkpoint_computes_in_float32_and_matches_hf(tmp_path: Path) -> None:
    hf_model = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", torch.bfloat16)
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.checkpoint_dtype == torch.bfloat16
    assert config.dtype == torch.float32
    runner = _runner(tmp_path)
    assert all(p.dtype == torch.float32 for p in runner.model.parameters())
    torch.testing.assert_close(
        _our_logits(runner, PROMPTS[1]), _hf_logits(hf_model, PROMPTS[1]), rtol=1e-4, atol=1e-4
    )
    expected = [hf_greedy_tokens(hf_model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    assert _greedy(runner) == expected


def test_qwen2_with_qkv_bias_matches_hf_greedy(tmp_path: Path) -> None:
    hf_model = make_tiny_checkpoint(tmp_path, "Qwen2ForCausalLM", torch.float32)
    assert hf_model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    runner = _runner(tmp_path)
    assert runner.model_config.attention_bias
    expected = [hf_greedy_tokens(hf_model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    assert _greedy(runner) == expected


def test_sharded_checkpoint_with_tied_embeddings_loads(tmp_path: Path) -> None:
    hf_model = make_tiny_checkpoint(
        tmp_path, "LlamaForCausalLM", torch.float16, tie_word_embeddings=True, max_shard_size="40KB"
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    runner = _runner(tmp_path)
    assert runner.model.lm_head is runner.model.embed_tokens
    torch.testing.assert_close(
        _our_logits(runner, PROMPTS[0]), _hf_logits(hf_model, PROMPTS[0]), rtol=1e-4, atol=1e-4
    )


def test_eos_ids_come_from_config_and_generation_config(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5, 9]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (5, 7, 9)


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(ModelConfig.from_pretrained(tmp_path))


def test_missing_weights_and_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelConfig.from_pretrained(tmp_path)
    make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", torch.float32, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_model(ModelConfig.from_pretrained(tmp_path))
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="missing weights"):
        load_model(ModelConfig.from_pretrained(tmp_path))
