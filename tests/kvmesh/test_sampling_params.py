"""kvmesh.SamplingParams: validated at construction, split into the engine's two halves."""

from __future__ import annotations

import pytest

from kvmesh import SamplingParams
from kvmesh.client import _sampling_proto
from kvmesh.sampling_params import as_list


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k) == (1, 16, 1.0, 1.0, 0)
    assert p.stop == () and p.skip_special_tokens and not p.ignore_eos


def test_a_single_stop_string_and_lists_become_tuples() -> None:
    p = SamplingParams(stop="\n", stop_token_ids=[5, 7], logit_bias={"3": 1})
    assert p.stop == ("\n",)
    assert p.stop_token_ids == (5, 7)
    assert p.logit_bias == {3: 1.0}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0},
        {"n": 129},
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 1.5},
        {"top_n_sigma": -1.0},
        {"top_n_sigma": float("inf")},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"min_tokens": 17},
        {"stop_token_ids": [-1]},
    ],
)
def test_bad_values_fail_at_construction(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_engine_and_detokenizer_halves() -> None:
    p = SamplingParams(
        max_tokens=9,
        temperature=0.0,
        top_k=-1,
        seed=3,
        stop=["END"],
        stop_token_ids=[2],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        logit_bias={7: -1.0, 4: 2.0},
    )
    engine = p.engine_params()
    assert engine.max_tokens == 9 and engine.is_greedy and engine.seed == 3
    assert engine.top_k == 0  # -1 and 0 both mean off; the engine says 0
    assert engine.stop_token_ids == (2,)
    assert engine.logit_bias == ((4, 2.0), (7, -1.0))
    text = p.detokenize_params()
    assert text.stop == ("END",)
    assert text.include_stop_str_in_output and not text.skip_special_tokens


def test_the_wire_form_carries_every_field() -> None:
    p = SamplingParams(
        n=2, max_tokens=5, temperature=0.5, seed=11, stop=["x"], min_tokens=1, top_n_sigma=1.5
    )
    proto = _sampling_proto(p)
    assert proto.top_n_sigma == 1.5 and p.engine_params().top_n_sigma == 1.5
    assert (proto.n, proto.max_tokens, proto.seed, list(proto.stop)) == (2, 5, 11, ["x"])
    assert proto.temperature == pytest.approx(0.5)
    assert proto.HasField("skip_special_tokens") and proto.skip_special_tokens
    assert not _sampling_proto(SamplingParams()).HasField("seed")


def test_one_params_per_prompt() -> None:
    a, b = SamplingParams(max_tokens=1), SamplingParams(max_tokens=2)
    assert as_list(None, 2) == [SamplingParams(), SamplingParams()]
    assert as_list(a, 3) == [a, a, a]
    assert as_list([a, b], 2) == [a, b]
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        as_list([a, b], 3)
