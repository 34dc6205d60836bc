"""Structured outputs in the worker: grammars compile (or are refused), the bitmask
constrains only its rows, and the real model's constrained output parses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from kvmesh.services.contracts.sampling_params import SamplingParams, StructuredOutputSpec
from kvmesh.worker.config import CacheConfig, ModelConfig
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.sampler import Sampler, apply_logits_processors
from kvmesh.worker.structured_output import GrammarCompilerCache, StructuredOutputManager
from tests.worker.sampling_lists import sampling_metadata_from_lists

from .conftest import truncate_at_eos

VOCAB = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]},
        "population": {"type": "integer"},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(model_path: Path) -> GrammarCompilerCache:
    return GrammarCompilerCache(model_path, VOCAB, [EOS])


@pytest.fixture(scope="module")
def tokenizer(model_path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_path / "tokenizer.json"))


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (StructuredOutputSpec("json", "{not json"), "json"),
        (StructuredOutputSpec("regex", "(unclosed"), "regex"),
        (StructuredOutputSpec("grammar", "root ::= "), "grammar"),
        (StructuredOutputSpec("choice", "[]"), "non-empty"),
        (StructuredOutputSpec("choice", '["a", 3]'), "string"),
    ],
)
def test_bad_specs_are_value_errors_that_say_why(compiler, spec, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        compiler.compile(spec)


def test_compiled_grammars_are_cached_by_spec(compiler) -> None:
    spec = StructuredOutputSpec("regex", "[0-9]{3}")
    assert compiler.get(spec) is None
    compiled = compiler.compile(spec)
    assert compiler.get(StructuredOutputSpec("regex", "[0-9]{3}")) is compiled


def _allowed(logits_row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits_row).nonzero().flatten().tolist())


def test_bitmask_masks_only_its_rows_and_forces_eos_when_complete(compiler, tokenizer) -> None:
    manager = StructuredOutputManager(compiler)
    manager.add_request("choice", StructuredOutputSpec("choice", '["yes", "no"]'), [])
    rows = torch.tensor([5, 9])  # batch rows; sampling position 0 is unconstrained
    step = manager.constrain(rows.numpy(), {"free": 5, "choice": 9})
    assert step is not None and step.positions == [1]
    params = [SamplingParams(temperature=0.0)] * 2
    metadata = sampling_metadata_from_lists(params, [[1], [1]], [[], []], {}, [EOS], VOCAB)
    metadata.grammar_bitmask, metadata.grammar_rows = step.bitmask, step.positions
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    processed = apply_logits_processors(logits, metadata)
    assert torch.equal(processed[0], logits[0])  # the free row is untouched
    allowed = _allowed(processed[1])
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    # Feed "yes": afterwards only EOS is allowed, so greedy sampling ends it.
    yes_ids = tokenizer.encode("yes", add_special_tokens=False).ids
    manager.accept(["choice"] * len(yes_ids), yes_ids)
    step = manager.constrain(rows.numpy(), {"free": 5, "choice": 9})
    metadata.grammar_bitmask, metadata.grammar_rows = step.bitmask, step.positions
    out = Sampler()(logits, metadata)
    assert out.token_ids[1].item() == EOS
    step.accept(out.token_ids.tolist())
    assert manager.constrain(rows.numpy(), {"free": 5, "choice": 9}) is None  # terminated


def test_a_token_outside_the_grammar_is_reported_as_the_request_error(compiler) -> None:
    manager = StructuredOutputManager(compiler)
    manager.add_request("r", StructuredOutputSpec("regex", "[0-9]+"), [])
    manager.accept(["r"], [EOS + 1000])
    assert list(manager.pop_errors()) == ["r"]
    assert manager.pop_errors() == {}


@pytest.fixture(scope="module")
def runner(model_path: Path) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_pretrained(model_path, max_model_len=256),
        CacheConfig(block_size=16, num_kv_blocks=64),
        num_threads=1,
    )


def _run(runner: ModelRunner, requests: dict[str, tuple[list[int], SamplingParams]], n: int):
    driver = LocalDriver(runner)
    for req_id, (prompt, params) in requests.items():
        driver.add_request(req_id, prompt, params, n)
    finished = driver.run()
    for req_id in requests:
        assert finished[req_id].error is None, finished[req_id].error
    return {r: truncate_at_eos(finished[r].output_token_ids, (EOS,)) for r in requests}


@pytest.mark.model
def test_model_output_follows_schema_and_regex_in_a_mixed_batch(runner, tokenizer) -> None:
    prompt = tokenizer.encode("Give me a city as JSON:").ids
    schema = StructuredOutputSpec("json", json.dumps(SCHEMA))
    date = StructuredOutputSpec("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
    greedy = SamplingParams(temperature=0.0)
    outputs = _run(
        runner,
        {
            "json": (prompt, SamplingParams(temperature=0.0, structured_output=schema)),
            "date": (prompt, SamplingParams(temperature=0.7, seed=3, structured_output=date)),
            "free": (prompt, greedy),
        },
        n=30,
    )
    assert outputs["json"][-1] == EOS
    value = json.loads(tokenizer.decode(outputs["json"][:-1]))
    jsonschema.validate(value, SCHEMA)
    assert outputs["date"][-1] == EOS
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", tokenizer.decode(outputs["date"][:-1]))
    # The unconstrained neighbour is exactly what it is alone.
    assert outputs["free"] == _run(runner, {"alone": (prompt, greedy)}, n=30)["alone"]


@pytest.mark.model
def test_resumed_request_replays_its_tokens_into_a_fresh_matcher(runner, tokenizer) -> None:
    prompt = tokenizer.encode("Pick a city:").ids
    params = SamplingParams(
        temperature=0.0, structured_output=StructuredOutputSpec("json", json.dumps(SCHEMA))
    )
    whole = _run(runner, {"whole": (prompt, params)}, n=24)["whole"]
    assert len(whole) > 6
    # As after a preemption: the first 5 tokens come back as output_token_ids.
    driver = LocalDriver(runner)
    request = driver.add_request("resumed", prompt, params, 24)
    request.output_token_ids = list(whole[:5])
    finished = driver.run()["resumed"]
    assert finished.error is None
    assert truncate_at_eos(finished.output_token_ids, (EOS,)) == whole


def test_a_thinking_request_samples_freely_until_its_thinking_ends(compiler, tokenizer) -> None:
    manager = StructuredOutputManager(compiler)
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False).ids)
    gated = StructuredOutputSpec("choice", '["yes", "no"]', reasoning_end_token_ids=end)
    manager.add_request("r", gated, [])
    rows = torch.tensor([3])
    step = manager.constrain(rows.numpy(), {"r": 3})
    assert step is not None and step.bitmask is None and step.thinking_req_ids == ["r"]
    assert manager.is_thinking("r") and "r" in manager
    thought = tokenizer.encode("hmm, yes? ", add_special_tokens=False).ids
    for token_id in [*thought, *end]:
        assert manager.is_thinking("r")
        manager.constrain(rows.numpy(), {"r": 3}).accept([token_id])  # type: ignore[union-attr]
    assert not manager.is_thinking("r")  # "</think>" arrived: the grammar starts now
    step = manager.constrain(rows.numpy(), {"r": 3})
    assert step is not None and step.bitmask is not None and step.positions == [0]
    logits = torch.zeros(1, VOCAB)
    metadata = sampling_metadata_from_lists(
        [SamplingParams(temperature=0.0)], [[1]], [[]], {}, [EOS], VOCAB
    )
    metadata.grammar_bitmask, metadata.grammar_rows = step.bitmask, step.positions
    texts = {tokenizer.decode([t]) for t in _allowed(apply_logits_processors(logits, metadata)[0])}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    # The gate is not part of the grammar: one compiled grammar serves both.
    assert compiler.get(gated) is compiler.get(StructuredOutputSpec("choice", '["yes", "no"]'))


def test_a_resumed_request_replays_only_what_followed_its_thinking(compiler, tokenizer) -> None:
    manager = StructuredOutputManager(compiler)
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False).ids)
    gated = StructuredOutputSpec("regex", "[0-9]+", reasoning_end_token_ids=end)
    digits = tokenizer.encode("12", add_special_tokens=False).ids
    # Thinking text no grammar allows, then the end, then digits: the replay fits.
    before = tokenizer.encode("words, not digits ", add_special_tokens=False).ids
    manager.add_request("done", gated, [*before, *end, *digits])
    assert not manager.is_thinking("done")
    manager.add_request("still", gated, before)
    assert manager.is_thinking("still")
    with pytest.raises(ValueError, match="does not fit"):
        manager.add_request("bad", gated, [*before, *end, *before])


@pytest.mark.model
def test_model_output_is_free_until_the_gate_then_follows_the_grammar(runner, tokenizer) -> None:
    prompt = tokenizer.encode("Tell me about Paris.").ids
    free = _run(runner, {"free": (prompt, SamplingParams(temperature=0.0))}, n=12)["free"]
    assert len(free) >= 6
    # Stand-in for "</think>": two tokens the model writes on its own, greedily.
    gate = tuple(free[2:4])
    spec = StructuredOutputSpec("regex", "[0-9]{3}", reasoning_end_token_ids=gate)
    params = SamplingParams(temperature=0.0, structured_output=spec)
    gated = _run(runner, {"gated": (prompt, params)}, n=12)["gated"]
    assert gated[:4] == free[:4]  # the thinking was not constrained
    assert gated[-1] == EOS
    assert re.fullmatch("[0-9]{3}", tokenizer.decode(gated[4:-1]))
