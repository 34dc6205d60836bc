"""The request table: per-request isolation of failures within one step."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from kvmesh.detokenizer.registry import DetokenizerTable, DetokenizerTableFullError, StepInput
from kvmesh.services.contracts.sampling_params import DetokenizeParams


def ids_of(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def test_step_failures_stay_with_their_request(tokenizer: Tokenizer) -> None:
    table = DetokenizerTable(tokenizer)
    for request_id in ("good-1", "bad-token", "good-2"):
        table.add(request_id, ids_of(tokenizer, "Hi"), DetokenizeParams())
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    results = table.process_step(
        [
            ("good-1", ids_of(tokenizer, "Hello"), False),
            ("bad-token", [*ids_of(tokenizer, "x"), vocab_size + 5], False),
            ("ghost", ids_of(tokenizer, "boo"), False),
            ("malformed",),
            StepInput("good-2", ids_of(tokenizer, "Bye"), True),
        ]
    )
    ids = ["good-1", "bad-token", "ghost", "malformed", "good-2"]
    assert [r.request_id for r in results] == ids
    assert [r.ok for r in results] == [True, False, False, False, True]
    assert results[0].delta is not None and results[0].delta.text == "Hello"
    assert results[4].delta is not None and results[4].delta.text == "Bye"
    assert "outside the vocabulary" in (results[1].error or "")
    assert "ghost" in (results[2].error or "")
    # The failed request is dropped; the finished one is gone; good-1 lives on.
    assert "bad-token" not in table and "good-2" not in table
    assert len(table) == 1
    next_step = table.process_step([("good-1", ids_of(tokenizer, " world"), True)])
    assert next_step[0].delta is not None and next_step[0].delta.text == " world"
    assert len(table) == 0


def test_stopped_request_kept_until_scheduler_finishes_it(tokenizer: Tokenizer) -> None:
    table = DetokenizerTable(tokenizer)
    table.add("r", [], DetokenizeParams(stop=("fox",)))
    first = table.process("r", ids_of(tokenizer, "The fox ran"), finished=False)
    assert first.stop_string == "fox" and first.text == "The " and first.finished
    # Tokens already in flight when the stop was found arrive one step later.
    late = table.process("r", ids_of(tokenizer, " away"), finished=True)
    assert late.text == "" and late.stop_string is None
    assert "r" not in table


def test_table_is_bounded_and_rejects_duplicates(tokenizer: Tokenizer) -> None:
    table = DetokenizerTable(tokenizer, max_num_requests=2)
    table.add("a", [], DetokenizeParams())
    with pytest.raises(KeyError):
        table.add("a", [], DetokenizeParams())
    table.add("b", [], DetokenizeParams())
    with pytest.raises(DetokenizerTableFullError):
        table.add("c", [], DetokenizeParams())
    assert table.remove("a") and not table.remove("a")
    table.add("c", [], DetokenizeParams())
    assert len(table) == 2


def test_per_request_params_are_independent(tokenizer: Tokenizer) -> None:
    table = DetokenizerTable(tokenizer)
    table.add("plain", [], DetokenizeParams(skip_special_tokens=False))
    table.add("stopping", [], DetokenizeParams(stop=("b",)))
    ids = [*ids_of(tokenizer, "a b c"), tokenizer.token_to_id("<|im_end|>")]
    results = table.process_step([("plain", ids, True), ("stopping", ids, True)])
    texts = {r.request_id: r.delta.text for r in results if r.delta is not None}
    assert texts == {"plain": "a b c<|im_end|>", "stopping": "a "}


def test_token_texts_only_when_asked(tokenizer: Tokenizer) -> None:
    table = DetokenizerTable(tokenizer)
    table.add("with", [], DetokenizeParams(), with_token_texts=True)
    table.add("without", [], DetokenizeParams())
    ids = ids_of(tokenizer, "one two")
    with_texts, without_texts = table.process_step([("with", ids, False), ("without", ids, False)])
    assert with_texts.delta is not None and with_texts.delta.token_texts == ["one", " two"]
    assert without_texts.delta is not None and without_texts.delta.token_texts is None
