"""A bfloat16 checkpoint served in float32 keeps its projections as bfloat16
words (kernels/bf16_weights.py: half the bytes) and still generates what
transformers generates in float32 from the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from kvmesh.kernels import native
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner

from .conftest import hf_greedy_tokens
from .model_families import make_family_checkpoint

NEW_TOKENS = 16
PROMPTS = [[(7 * i + 3) % 160 for i in range(40)], [5, 9, 11, 2, 150, 31, 77]]


def test_bf16_checkpoint_in_float32_runs_on_its_words_like_transformers(tmp_path: Path) -> None:
    import transformers

    make_family_checkpoint(tmp_path / "f32", "Qwen3ForCausalLM")
    model = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "f32", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16", safe_serialization=True)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(
        tmp_path / "bf16", dtype=torch.float32
    ).eval()
    expected = [hf_greedy_tokens(hf, p, NEW_TOKENS, min_new_tokens=NEW_TOKENS) for p in PROMPTS]
    assert all(len(set(tokens)) > 1 for tokens in expected), expected

    runner = ModelRunner(
        ModelConfig.from_pretrained(tmp_path / "bf16", dtype="float32"),
        CacheConfig(block_size=4, num_kv_blocks=64),
        num_threads=1,
    )
    packed = runner.model._all_packed()
    if native.unavailable_reason() is None:
        # Every projection (the LM head too) holds 2 bytes per weight, no float32 copy.
        assert packed and all(p.keeps_bf16_words for p in packed)
    driver = LocalDriver(runner, chunk_size=16)
    for index, prompt in enumerate(PROMPTS):
        driver.add_request(f"r{index}", prompt, SamplingParams(temperature=0.0), NEW_TOKENS)
    finished = driver.run()
    assert [finished[f"r{i}"].output_token_ids for i in range(len(PROMPTS))] == expected
