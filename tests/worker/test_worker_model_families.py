"""Every served family is exact against transformers float32 on a tiny random
checkpoint: greedy tokens (vLLM's rule: equal until a first difference where
each side's token is in the other's top 5; here they must be equal
throughout), with chunked prefill and a prefix-cache hit, and at TP=2."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.config_checks import UnsupportedModelError
from kvmesh.worker.models.features import Features
from kvmesh.worker.models.registry import check_model, get_model_class
from tests.lora_adapters import lora_request, make_lora_adapter

from .conftest import hf_greedy_tokens
from .gguf_files import write_tiny_gguf
from .model_families import make_family_checkpoint
from .parallel_ranks import RunSpec, run_replica, run_single
from .test_worker_model_loader import _hf_logits, _our_logits
from .test_worker_parallel_replica import assert_same_outputs

FAMILIES = [
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "SmolLM3ForCausalLM",
]
NEW_TOKENS = 24
BLOCK = 4
# A long prompt (chunked below), a short one, and a prompt sharing the long
# one's first 40 tokens (its prefix-cache hit).
LONG = [(7 * i + 3) % 160 for i in range(70)]
PROMPTS = [LONG, [5, 9, 11, 2, 150, 31, 77], [*LONG[:40], 12, 13, 14, 15, 16]]


def _runner(folder: Path) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(folder),
        CacheConfig(block_size=BLOCK, num_kv_blocks=128),
        num_threads=1,
    )


def _greedy(runner: ModelRunner) -> list[list[int]]:
    """Prompts 0 and 1 in 16-token chunks; prompt 2 then reuses prompt 0's
    first 40 tokens' blocks (computed, not recomputed)."""
    driver = LocalDriver(runner, chunk_size=16, free_on_finish=False)
    for index, prompt in enumerate(PROMPTS[:2]):
        driver.add_request(f"r{index}", prompt, SamplingParams(temperature=0.0), NEW_TOKENS)
    finished = driver.run()
    shared = finished["r0"].block_ids[: 40 // BLOCK]
    driver.add_request(
        "r2",
        PROMPTS[2],
        SamplingParams(temperature=0.0),
        NEW_TOKENS,
        prefix_block_ids=shared,
        num_computed_tokens=40,
    )
    finished.update(driver.run())
    return [finished[f"r{i}"].output_token_ids for i in range(len(PROMPTS))]


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, list[list[int]]]:
    """(architecture, checkpoint folder, transformers' greedy tokens per prompt)."""
    architecture: str = request.param
    folder = tmp_path_factory.mktemp(architecture)
    hf_model = make_family_checkpoint(folder, architecture)
    expected = [
        hf_greedy_tokens(hf_model, prompt, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        for prompt in PROMPTS
    ]
    return architecture, folder, expected


def test_family_matches_transformers_greedy(family: tuple[str, Path, list[list[int]]]) -> None:
    architecture, folder, expected = family
    # Random weights can make flat logits: the check means something only if
    # the continuation varies.
    assert all(len(set(tokens)) > 1 for tokens in expected), (architecture, expected)
    assert _greedy(_runner(folder)) == expected


# What each family does that Llama does not, removed: the parity check must
# then fail (so it would catch the feature being ignored).
MUTATIONS = {
    "Qwen3ForCausalLM": {"qk_norm": ""},
    "Gemma2ForCausalLM": {"attention_scale": None},  # query_pre_attn_scalar ignored
    "Gemma3ForCausalLM": {"layer_rope": (0, 0, 0)},  # local layers on the global base
    "Olmo2ForCausalLM": {"qk_norm": ""},
    "GraniteForCausalLM": {"residual_multiplier": 1.0},
    "Qwen3MoeForCausalLM": {"moe_renormalize": False},  # norm_topk_prob ignored
    "MixtralForCausalLM": {"moe_top_k": 1},
    "SmolLM3ForCausalLM": {"layer_nope": None},  # the NoPE layer rotated
}


def test_ignoring_the_familys_feature_fails_parity(
    family: tuple[str, Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    architecture, folder, expected = family
    if architecture not in MUTATIONS:
        pytest.skip(f"{architecture} is Llama's forward over other checkpoint names")
    model_class = get_model_class(architecture)
    features = model_class.family_features

    def without_feature(config: ModelConfig) -> Features:
        return dataclasses.replace(features(config), **MUTATIONS[architecture])

    monkeypatch.setattr(model_class, "family_features", staticmethod(without_feature))
    assert _greedy(_runner(folder)) != expected


def test_gemma2_final_soft_cap_is_in_the_logits(tmp_path: Path) -> None:
    """Soft-capping keeps the order of the logits (greedy cannot see it), so
    the logits themselves are compared, and fail without the cap."""
    hf_model = make_family_checkpoint(tmp_path, "Gemma2ForCausalLM")
    runner = _runner(tmp_path)
    expected = _hf_logits(hf_model, PROMPTS[1])
    torch.testing.assert_close(_our_logits(runner, PROMPTS[1]), expected, rtol=1e-4, atol=1e-4)
    assert float(expected.abs().max()) <= 3.0  # the cap (family_config's 3.0)
    runner.model.features = dataclasses.replace(runner.model.features, final_logit_softcap=None)
    assert not torch.allclose(_our_logits(runner, PROMPTS[1]), expected, rtol=1e-4, atol=1e-4)


def test_phi3_longrope_below_its_original_length_matches_transformers(tmp_path: Path) -> None:
    """LongRoPE's short factors and attention factor (max_model_len within the
    original length; beyond it transformers switches tables mid-run: refused)."""
    half = 64 // 4 // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.3 * i for i in range(half)],
        "long_factor": [2.0 + i for i in range(half)],
        "original_max_position_embeddings": 128,
    }
    hf_model = make_family_checkpoint(
        tmp_path, "Phi3ForCausalLM", rope_parameters=rope, original_max_position_embeddings=128
    )
    expected = [
        hf_greedy_tokens(hf_model, p, NEW_TOKENS, min_new_tokens=NEW_TOKENS) for p in PROMPTS
    ]
    runner = ModelRunner(
        ModelConfig.from_pretrained(tmp_path, max_model_len=128),
        CacheConfig(block_size=BLOCK, num_kv_blocks=128),
        num_threads=1,
    )
    assert _greedy(runner) == expected
    with pytest.raises(UnsupportedModelError, match=r"--max-model-len <= 128"):
        check_model(ModelConfig.from_pretrained(tmp_path, max_model_len=256))


@pytest.mark.parametrize(
    ("rope", "max_model_len"),
    [
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            256,
        ),
        ({"rope_type": "linear", "factor": 2.0}, 256),
        ({"rope_type": "dynamic", "factor": 2.0}, 256),
    ],
    ids=lambda v: v["rope_type"] if isinstance(v, dict) else str(v),
)
def test_llama_rope_scaling_matches_transformers(
    tmp_path: Path, rope: dict, max_model_len: int
) -> None:
    hf_model = make_family_checkpoint(
        tmp_path, "LlamaForCausalLM", rope_parameters={"rope_theta": 10000.0, **rope}
    )
    expected = [
        hf_greedy_tokens(hf_model, p, NEW_TOKENS, min_new_tokens=NEW_TOKENS) for p in PROMPTS
    ]
    assert _greedy(_runner(tmp_path)) == expected


def _with_config(folder: Path, **fields: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"architectures": ["DeepseekV3ForCausalLM"]}, "unsupported architecture"),
        (
            {"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}},
            r"rope_parameters\.rope_type='su'",
        ),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method"),
        ({"kv_lora_rank": 512}, "kv_lora_rank=512"),
        ({"sliding_window": -1}, r"sliding_window=-1 .* supported: a positive number"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"hidden_act": "relu"}, "hidden_act='relu'"),
        ({"attention_bias": True}, "attention_bias=True"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_unimplemented_config_fields_are_refused_at_start_up(
    tmp_path: Path, fields: dict, message: str
) -> None:
    """Mistral's sliding_window, an unknown rope type, a quantized checkpoint...:
    each names its field and what is supported, never served approximately."""
    make_family_checkpoint(tmp_path, "LlamaForCausalLM")
    _with_config(tmp_path, **{"architectures": ["MistralForCausalLM"], **fields})
    with pytest.raises(UnsupportedModelError, match=message):
        check_model(ModelConfig.from_pretrained(tmp_path))


def test_short_windows_and_attention_softcap_are_served(tmp_path: Path) -> None:
    """A window far shorter than max_model_len and Gemma 2's attention
    soft-cap are implemented (tests/worker/test_worker_sliding_window_models.py
    checks them against transformers); a cap that is not positive is refused."""
    make_family_checkpoint(tmp_path, "Gemma2ForCausalLM")
    _with_config(tmp_path, sliding_window=16, attn_logit_softcapping=50.0)
    config = ModelConfig.from_pretrained(tmp_path, max_model_len=256)
    model_class = check_model(config)
    assert {s.sliding_window for s in model_class.kv_cache_spec(config)} == {16, None}
    assert model_class.family_features(config).attn_logit_softcap == 50.0
    _with_config(tmp_path, attn_logit_softcapping=0.0)
    with pytest.raises(UnsupportedModelError, match=r"attn_logit_softcapping=0\.0"):
        check_model(ModelConfig.from_pretrained(tmp_path, max_model_len=256))


def _smollm3_config(folder: Path, drop: tuple[str, ...] = (), **fields: object) -> ModelConfig:
    """A SmolLM3 config.json as transformers writes it (no weights: only the
    config is read), less the fields ``drop`` names (older writers' files)."""
    import transformers

    from .model_families import family_config

    hf = family_config("SmolLM3ForCausalLM", **fields).to_dict()
    hf["architectures"] = ["SmolLM3ForCausalLM"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if k not in drop}))
    assert transformers.SmolLM3Config.from_pretrained(folder).num_hidden_layers == 4
    return ModelConfig.from_pretrained(folder)


@pytest.mark.parametrize(
    ("fields", "drop"),
    [
        ({}, ()),
        ({"no_rope_layer_interval": 2}, ("no_rope_layers", "layer_types")),
        ({"no_rope_layers": [0, 1, 0, 1]}, ()),
        ({"use_sliding_window": True, "sliding_window": 8}, ()),
        ({"use_sliding_window": True, "sliding_window": 8}, ("layer_types",)),
        ({"use_sliding_window": True, "sliding_window": 8, "no_rope_layer_interval": 2}, ()),
    ],
)
def test_smollm3_nope_and_windowed_layers_are_transformers(
    tmp_path: Path, fields: dict, drop: tuple[str, ...]
) -> None:
    """Which layers skip the rotation and which attend over a window, read from
    config.json (or derived where it lacks the lists, as transformers derives
    them), equal transformers' own layers' ``use_rope`` and ``sliding_window``."""
    import transformers

    config = _smollm3_config(tmp_path, drop, **fields)
    model_class = check_model(config)
    theirs = transformers.SmolLM3Model(transformers.SmolLM3Config.from_pretrained(tmp_path))
    attention = [layer.self_attn for layer in theirs.layers]
    nope = model_class.family_features(config).layer_nope
    assert nope == tuple(not a.use_rope for a in attention)
    assert any(nope)
    windows = [s.sliding_window for s in model_class.kv_cache_spec(config)]
    assert windows == [a.sliding_window for a in attention]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"no_rope_layers": [1, 0]}, r"no_rope_layers=\[1, 0\] .* 4 or more flags"),
        ({"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers=.* each 0 or 1"),
        ({"layer_types": ["full_attention"] * 3 + ["chunked_attention"]}, "layer_types="),
        (
            {"layer_types": ["full_attention"] * 3 + ["sliding_attention"]},
            "without use_sliding_window=true",
        ),
        ({"attention_bias": True}, "attention_bias=True"),
    ],
    ids=["short-no_rope_layers", "flag-2", "chunked", "window-unset", "attention_bias"],
)
def test_smollm3_fields_it_does_not_implement_are_refused(
    tmp_path: Path, fields: dict, message: str
) -> None:
    """A layer list shorter than the model, an attention type kvmesh lacks, and
    sliding layers whose attention depends on transformers' implementation."""
    config = _smollm3_config(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **fields}))
    with pytest.raises(UnsupportedModelError, match=message):
        check_model(ModelConfig.from_pretrained(tmp_path))
    assert check_model(config) is get_model_class("SmolLM3ForCausalLM")


@pytest.mark.parametrize(
    "architecture",
    [
        "Qwen3ForCausalLM",
        "Olmo2ForCausalLM",
        "Phi3ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma2ForCausalLM",
        "GraniteForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "SmolLM3ForCausalLM",
    ],
)
def test_family_at_tp2_matches_one_process(tmp_path: Path, architecture: str) -> None:
    """Two gloo ranks: per-head q/k norms, OLMo 2's whole-projection norm (one
    all-reduce of the sums of squares), Phi-3's fused tensors cut run by run,
    every expert's MLP width split like a dense MLP's."""
    make_family_checkpoint(tmp_path, architecture)
    spec = RunSpec(str(tmp_path), [PROMPTS[0][:30], PROMPTS[1]], chunk_size=8)
    assert_same_outputs(run_single(spec), run_replica(2, 1, spec))


@pytest.mark.parametrize(
    ("architecture", "targets"),
    [
        ("Phi3ForCausalLM", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
        ("Qwen3ForCausalLM", "all-linear"),
        ("Gemma3ForCausalLM", ("q_proj", "v_proj", "down_proj")),
        ("SmolLM3ForCausalLM", ("q_proj", "k_proj", "o_proj", "up_proj")),
    ],
)
def test_family_lora_equals_transformers_peft(
    tmp_path: Path, architecture: str, targets: tuple[str, ...] | str
) -> None:
    """An adapter on the family's own PEFT modules (Phi-3's fused ones) equals
    transformers + PEFT: the declaration's targets name and cut them."""
    make_family_checkpoint(tmp_path / "base", architecture)
    peft_model = make_lora_adapter(
        tmp_path / "base",
        tmp_path / "lora",
        rank=4,
        alpha=8.0,
        target_modules=targets,
        seed=1,
        scale=0.3,
    )
    prompts = PROMPTS[:2]
    expected = [hf_greedy_tokens(peft_model, p, 12, min_new_tokens=12) for p in prompts]
    runner = ModelRunner(
        ModelConfig.from_pretrained(tmp_path / "base"),
        CacheConfig(block_size=BLOCK, num_kv_blocks=128),
        num_threads=1,
        max_loras=1,
        max_lora_rank=8,
    )
    driver = LocalDriver(runner, chunk_size=16)
    lora = lora_request("a", tmp_path / "lora")
    for index, prompt in enumerate(prompts):
        driver.add_request(
            f"r{index}", prompt, SamplingParams(temperature=0.0), 12, lora_request=lora
        )
    finished = driver.run()
    assert [finished[f"r{i}"].output_token_ids for i in range(len(prompts))] == expected


def test_an_adapter_for_modules_the_family_lacks_fails_its_request(tmp_path: Path) -> None:
    """A Llama-named adapter on Phi-3 (no q_proj there) is refused by name."""
    make_family_checkpoint(tmp_path / "llama", "LlamaForCausalLM")
    make_lora_adapter(
        tmp_path / "llama",
        tmp_path / "lora",
        rank=4,
        alpha=8.0,
        target_modules=("q_proj",),
        seed=1,
        scale=0.3,
    )
    make_family_checkpoint(tmp_path / "phi3", "Phi3ForCausalLM")
    runner = ModelRunner(
        ModelConfig.from_pretrained(tmp_path / "phi3"),
        CacheConfig(block_size=BLOCK, num_kv_blocks=64),
        num_threads=1,
        max_loras=1,
        max_lora_rank=8,
    )
    driver = LocalDriver(runner)
    driver.add_request(
        "r",
        PROMPTS[1],
        SamplingParams(temperature=0.0),
        4,
        lora_request=lora_request("a", tmp_path / "lora"),
    )
    error = driver.run()["r"].error
    assert error is not None and "['q_proj'] are not projections of this model" in error


def test_qwen3_gguf_runs_from_codes_like_its_dequantized_checkpoint(tmp_path: Path) -> None:
    """A Qwen3 GGUF file (llama.cpp's "qwen3" names, q/k norms, rows not
    permuted) loads through the declaration and equals its dequantized weights."""
    make_family_checkpoint(tmp_path / "ckpt", "Qwen3ForCausalLM")
    named, reference = write_tiny_gguf(tmp_path / "ckpt", tmp_path)
    ours, ref = _runner(named), _runner(reference)
    assert ours.model_config.gguf_file.endswith("tiny.gguf")
    assert ours.model.weight_bytes()["codes_only_projections"] > 0
    torch.testing.assert_close(
        _our_logits(ours, PROMPTS[1]), _our_logits(ref, PROMPTS[1]), rtol=1e-5, atol=1e-5
    )
    assert _greedy(ours) == _greedy(ref)
