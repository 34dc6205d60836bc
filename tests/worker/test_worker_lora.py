"""Multi-LoRA in the worker: greedy output with each adapter equals transformers + PEFT
(float32), a step mixing adapters and the base model equals each request alone, and
the slot pool loads, evicts and fails per request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.kernels import native
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from tests.lora_adapters import lora_request, make_lora_adapter

from .conftest import hf_greedy_tokens, make_tiny_checkpoint

MAX_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
# name -> (rank, alpha, target modules, rslora): every fused slice alone and together.
ADAPTERS = {
    "all": (
        8,
        16.0,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        False,
    ),
    "qv": (4, 8.0, ("q_proj", "v_proj"), True),
    "mlp": (16, 8.0, ("up_proj", "down_proj", "k_proj"), False),
    "wide": (16, 32.0, "all-linear", False),
}
PROMPTS = [[3, 17, 42, 99, 5, 8, 61, 23, 77, 12, 34, 56, 78, 90, 11, 2, 7], [50, 51, 52], [9] * 21]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, LoRARequest], dict]:
    root = tmp_path_factory.mktemp("lora")
    base_folder = root / "base"
    base = make_tiny_checkpoint(base_folder, "LlamaForCausalLM", torch.float32)
    expected: dict[str | None, list[list[int]]] = {
        None: [hf_greedy_tokens(base, p, MAX_NEW_TOKENS) for p in PROMPTS]
    }
    requests = {}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        folder = root / name
        peft_model = make_lora_adapter(
            base_folder,
            folder,
            rank=rank,
            alpha=alpha,
            target_modules=targets,
            seed=seed,
            scale=0.3,
            use_rslora=rslora,
        )
        requests[name] = lora_request(name, folder)
        expected[name] = [hf_greedy_tokens(peft_model, p, MAX_NEW_TOKENS) for p in PROMPTS]
    return base_folder, requests, expected


def _runner(base_folder: Path, max_loras: int) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(base_folder, max_model_len=128),
        CacheConfig(block_size=4, num_kv_blocks=256),
        num_threads=1,
        max_loras=max_loras,
        max_lora_rank=16,
    )


def _run(runner: ModelRunner, jobs: list[tuple[str, list[int], LoRARequest | None]], **kw):
    driver = LocalDriver(runner, **kw)
    for req_id, prompt, lora in jobs:
        driver.add_request(req_id, prompt, GREEDY, MAX_NEW_TOKENS, lora_request=lora)
    return driver.run()


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_each_adapter_alone_equals_transformers_peft(tiny, kernel: str) -> None:
    base_folder, requests, expected = tiny
    runner = _runner(base_folder, max_loras=2)
    assert runner.lora_slots is not None
    # On CPU the C++ kernel is chosen at load wherever it builds.
    assert runner.lora_slots.native == (native.unavailable_reason() is None)
    if kernel == "torch":
        runner.lora_slots.set_native(False)
    elif not runner.lora_slots.native:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    for name in [None, *requests]:
        jobs = [(f"{name}-{i}", p, requests.get(name)) for i, p in enumerate(PROMPTS)]
        finished = _run(runner, jobs)
        got = [finished[req_id].output_token_ids for req_id, _, _ in jobs]
        assert got == expected[name], name
    # Every adapter changes what the model says.
    for name in requests:
        assert expected[name] != expected[None], name


def test_mixed_step_of_three_adapters_and_base_equals_each_alone(tiny) -> None:
    base_folder, requests, expected = tiny
    runner = _runner(base_folder, max_loras=3)
    names = [None, "all", "qv", "mlp"]
    # Interleaved so that the worker has to regroup the step by adapter;
    # chunked so prefills of one adapter share steps with decodes of another.
    jobs = [
        (f"{name}-{i}", prompt, requests.get(name))
        for i, prompt in enumerate(PROMPTS)
        for name in names
    ]
    finished = _run(runner, jobs, chunk_size=5)
    for req_id, _, lora in jobs:
        name = None if lora is None else lora.lora_name
        index = int(req_id.rsplit("-", 1)[1])
        assert finished[req_id].error is None
        assert finished[req_id].output_token_ids == expected[name][index], req_id


def test_slots_evict_least_recently_used(tiny) -> None:
    base_folder, requests, expected = tiny
    runner = _runner(base_folder, max_loras=2)
    slots = runner.lora_slots
    assert slots is not None
    for name in ["all", "qv", "all", "mlp"]:
        finished = _run(runner, [(name, PROMPTS[0], requests[name])])
        assert finished[name].output_token_ids == expected[name][0]
    # "qv" was least recently used when "mlp" needed a slot.
    assert slots.loaded_ids == [requests["all"].lora_id, requests["mlp"].lora_id]


def test_bad_adapter_fails_its_requests_only(tiny, tmp_path: Path) -> None:
    base_folder, requests, expected = tiny
    runner = _runner(base_folder, max_loras=2)
    missing = LoRARequest("missing", "0" * 64, str(tmp_path / "nowhere"))
    finished = _run(runner, [("bad", PROMPTS[0], missing), ("good", PROMPTS[0], requests["qv"])])
    assert "failed to load" in (finished["bad"].error or "")
    assert finished["good"].output_token_ids == expected["qv"][0]


def test_rank_above_max_lora_rank_is_refused(tiny) -> None:
    base_folder, requests, _ = tiny
    runner = ModelRunner(
        ModelConfig.from_pretrained(base_folder, max_model_len=64),
        CacheConfig(block_size=4, num_kv_blocks=64),
        num_threads=1,
        max_loras=1,
        max_lora_rank=8,
    )
    finished = _run(runner, [("wide", PROMPTS[1], requests["wide"])])
    assert "exceeds --max-lora-rank 8" in (finished["wide"].error or "")


def test_worker_without_lora_refuses_adapter_requests(tiny) -> None:
    base_folder, requests, expected = tiny
    runner = _runner(base_folder, max_loras=0)
    finished = _run(runner, [("a", PROMPTS[1], requests["qv"]), ("b", PROMPTS[1], None)])
    assert "not enabled" in (finished["a"].error or "")
    assert finished["b"].output_token_ids == expected[None][1]


def test_failure_on_another_rank_frees_the_slot_here() -> None:
    # LoRASlots alone: "b" loads here but another rank reports it failed.
    from kvmesh.services.contracts.lora_files import AdapterConfig
    from kvmesh.worker.lora.adapter import LoRAAdapter
    from kvmesh.worker.lora.slots import LoRASlots, ProjectionShape

    loaded: list[str] = []

    def load(lora: LoRARequest) -> LoRAAdapter:
        loaded.append(lora.lora_id)
        return LoRAAdapter(AdapterConfig(rank=2, alpha=2.0, target_modules=("o_proj",)), {})

    calls: list[dict[str, str]] = []
    elsewhere = {"b": "LoRA adapter 'b' failed to load: not on rank 1"}

    def agree(errors: dict[str, str]) -> dict[str, str]:
        calls.append(dict(errors))
        return {**elsewhere, **errors}

    shapes = [{"o": ProjectionShape(4, (("o_proj", 0, 4),))}]
    slots = LoRASlots(shapes, 2, 2, load, torch.float32, torch.device("cpu"), agree)
    a, b = (LoRARequest(name, name, f"/adapters/{name}") for name in "ab")
    slot_of, errors = slots.activate({"a": a, "b": b})
    assert list(slot_of) == ["a"] and errors == elsewhere
    assert slots.loaded_ids == ["a"]
    # Nothing to load: no agreement round (the ranks agree on when to hold one).
    assert slots.activate({"a": a}) == ({"a": slot_of["a"]}, {})
    assert len(calls) == 1
    # "b" took a slot and gave it back: loading it again finds one free.
    elsewhere.clear()
    slot_of, errors = slots.activate({"b": b})
    assert errors == {} and loaded == ["a", "b", "b"] and len(calls) == 2
    assert sorted(slots.loaded_ids) == ["a", "b"]
