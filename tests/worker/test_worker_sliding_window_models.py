"""Sliding windows and attention soft-capping against transformers float32.

Mistral (every layer over its window), Gemma 2 (alternating windowed layers,
attention-score soft-cap), Gemma 3 (local/global layers) and SmolLM3 (its
NoPE layers windowed, with ``use_sliding_window``), on tiny random
checkpoints whose window (16 tokens) is far shorter than the prompts (70 and
45 tokens, prefilled in 16-token chunks, one with a prefix-cache hit) and
the 24 generated tokens. Compared as vLLM's model tests compare (greedy
tokens equal until a first difference, where each side's token is in the
other's top 5), and in float32 equal throughout, as the other family tests
require. Each feature removed from the model must fail the check.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvmesh.services.contracts.kv_cache_groups import KVCacheGroup
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.declaration import LayerKVSpec
from kvmesh.worker.models.features import Features
from kvmesh.worker.models.registry import check_model, get_model_class

from .conftest import hf_greedy_tokens
from .model_families import make_family_checkpoint
from .test_worker_model_families import BLOCK, NEW_TOKENS, PROMPTS, _greedy
from .test_worker_model_loader import _hf_logits, _our_logits

WINDOW = 16
# Checkpoint fields per architecture: windows shorter than every prompt.
CHECKPOINTS = {
    "MistralForCausalLM": {"sliding_window": WINDOW},
    "Gemma2ForCausalLM": {
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 5.0,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "Gemma3ForCausalLM": {"sliding_window": WINDOW},
    # Its one NoPE layer (of four) windowed, as transformers derives layer_types.
    "SmolLM3ForCausalLM": {"use_sliding_window": True, "sliding_window": WINDOW},
}


def _runner_one_table(folder: Path) -> ModelRunner:
    """Every layer in one KV-cache group (one block table per request, nothing freed):
    these tests drive the runner directly, one table per request, and check the
    attention itself; the per-group tables and freed blocks are
    tests/worker/test_worker_kv_cache_groups.py's."""
    config = ModelConfig.from_pretrained(folder)
    return ModelRunner(
        config,
        CacheConfig(block_size=BLOCK, num_kv_blocks=128),
        num_threads=1,
        kv_cache_groups=(KVCacheGroup(None, tuple(range(config.num_layers))),),
    )


def _top5(logits: torch.Tensor) -> set[int]:
    return set(torch.topk(logits.float(), 5).indices.tolist())


def vllm_rule_failure(
    hf_model: torch.nn.Module,
    runner: ModelRunner,
    prompt: list[int],
    ours: list[int],
    theirs: list[int],
) -> str | None:
    """Why ``ours`` fails vLLM's comparison with ``theirs`` (None: it passes):
    equal up to a first difference, where each side's token must be in the
    other side's top 5 at that (shared) prefix; nothing is compared after it."""
    if len(ours) != len(theirs):
        return f"lengths {len(ours)} != {len(theirs)}"
    for index, (mine, hf) in enumerate(zip(ours, theirs, strict=True)):
        if mine == hf:
            continue
        prefix = [*prompt, *ours[:index]]
        hf_top = _top5(_hf_logits(hf_model, prefix)[-1])
        our_top = _top5(_our_logits(runner, prefix)[-1])
        if mine in hf_top and hf in our_top:
            return None
        return f"token {index}: ours {mine} (hf top5 {hf_top}), hf {hf} (our top5 {our_top})"
    return None


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def windowed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, torch.nn.Module, list[list[int]]]:
    """(architecture, folder, transformers' eager float32 model, its greedy tokens)."""
    architecture: str = request.param
    folder = tmp_path_factory.mktemp(architecture)
    hf_model = make_family_checkpoint(
        folder, architecture, attn_implementation="eager", **CHECKPOINTS[architecture]
    )
    expected = [
        hf_greedy_tokens(hf_model, prompt, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        for prompt in PROMPTS
    ]
    return architecture, folder, hf_model, expected


def _failures(
    hf_model: torch.nn.Module, runner: ModelRunner, expected: list[list[int]]
) -> list[str]:
    """Why the runner's greedy tokens fail the parity check (empty: they pass)."""
    ours = _greedy(runner)
    failures = [
        f"prompt {i}: {why}"
        for i, (prompt, mine, theirs) in enumerate(zip(PROMPTS, ours, expected, strict=True))
        if (why := vllm_rule_failure(hf_model, runner, prompt, mine, theirs)) is not None
    ]
    if not failures and ours != expected:  # float32: no near-tie excuse needed
        failures.append(f"tokens differ after a top-5 near-tie: {ours} != {expected}")
    return failures


def test_windowed_family_matches_transformers(
    windowed: tuple[str, Path, torch.nn.Module, list[list[int]]],
) -> None:
    architecture, folder, hf_model, expected = windowed
    # Served (no refusal) with max_model_len far past the window.
    config = ModelConfig.from_pretrained(folder)
    assert config.max_model_len > WINDOW
    check_model(config)
    specs = get_model_class(architecture).kv_cache_spec(config)
    assert WINDOW in {s.sliding_window for s in specs}
    # Random weights can give flat logits: the check means something only if
    # each continuation varies.
    assert all(len(set(tokens)) > 1 for tokens in expected), expected
    assert all(len(p) > 2 * WINDOW for p in PROMPTS[::2])
    runner = _runner_one_table(folder)
    assert _failures(hf_model, runner, expected) == []


def test_ignoring_the_window_fails_parity(
    windowed: tuple[str, Path, torch.nn.Module, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every layer over the whole context (the window dropped from the
    KV-cache spec the kernels read): the check above must then fail."""
    architecture, folder, hf_model, expected = windowed
    model_class = get_model_class(architecture)
    specs = model_class.kv_cache_spec

    def without_window(config: ModelConfig) -> list[LayerKVSpec]:
        return [dataclasses.replace(s, sliding_window=None) for s in specs(config)]

    monkeypatch.setattr(model_class, "kv_cache_spec", staticmethod(without_window))
    assert _failures(hf_model, _runner_one_table(folder), expected) != []


def test_ignoring_gemma2_attention_softcap_fails_parity(
    windowed: tuple[str, Path, torch.nn.Module, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    architecture, folder, hf_model, expected = windowed
    if architecture != "Gemma2ForCausalLM":
        pytest.skip("only Gemma 2 soft-caps attention scores")
    model_class = get_model_class(architecture)
    features = model_class.family_features

    def without_cap(config: ModelConfig) -> Features:
        return dataclasses.replace(features(config), attn_logit_softcap=None)

    monkeypatch.setattr(model_class, "family_features", staticmethod(without_cap))
    assert _failures(hf_model, _runner_one_table(folder), expected) != []


def test_window_logits_match_transformers_at_every_position(
    windowed: tuple[str, Path, torch.nn.Module, list[list[int]]],
) -> None:
    """A whole 70-token prompt in one step (the prefill kernels over 4 windows)."""
    _, folder, hf_model, _ = windowed
    prompt = PROMPTS[0]
    torch.testing.assert_close(
        _our_logits(_runner_one_table(folder), prompt),
        _hf_logits(hf_model, prompt),
        rtol=1e-4,
        atol=1e-4,
    )
