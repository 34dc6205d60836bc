"""The step contract survives the wire unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.protos import common_pb2
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.sampling_params import (
    DetokenizeParams,
    SamplingParams,
    StructuredOutputSpec,
)
from kvmesh.services.contracts.step import (
    CachedRequestData,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransfer,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)
from kvmesh.services.contracts.step_codec import (
    detokenize_params_from_proto,
    detokenize_params_to_proto,
    model_runner_output_from_proto,
    model_runner_output_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
    scheduler_output_from_proto,
    scheduler_output_to_proto,
)


def _params(**kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=33,
        temperature=0.5,
        top_p=0.75,
        top_k=7,
        min_p=0.125,
        top_n_sigma=1.5,
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.25,
        min_tokens=3,
        ignore_eos=True,
        stop_token_ids=(5, 9),
        logit_bias=((11, 2.5), (12, -100.0)),
        logprobs=4,
        prompt_logprobs=2,
        allowed_token_ids=(3, 5, 8),
        bad_words_token_ids=((17,), (4, 9, 4)),
        **kw,
    )


def test_sampling_params_round_trip() -> None:
    p = _params()
    # Every field away from its default (the ones with their own tests aside), so a
    # field added to SamplingParams but not to the codec fails here.
    own_tests = {"structured_output", "pooling"}
    defaults = SamplingParams()
    at_default = [
        f.name
        for f in dataclasses.fields(SamplingParams)
        if f.name not in own_tests and getattr(p, f.name) == getattr(defaults, f.name)
    ]
    assert not at_default, f"set these in _params: {at_default}"
    assert sampling_params_from_proto(sampling_params_to_proto(p)) == p
    plain = SamplingParams()
    back = sampling_params_from_proto(sampling_params_to_proto(plain))
    assert back == plain and back.seed is None and back.logprobs is None


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputSpec("json", '{"type": "object"}'),
        StructuredOutputSpec("json_object"),
        StructuredOutputSpec("regex", "[0-9]+"),
        StructuredOutputSpec("choice", '["yes", "no"]'),
        StructuredOutputSpec("grammar", 'root ::= "a"'),
    ],
)
def test_structured_output_round_trip(spec: StructuredOutputSpec) -> None:
    p = _params(structured_output=spec)
    back = sampling_params_from_proto(sampling_params_to_proto(p))
    assert back == p and back.structured_output == spec
    assert sampling_params_from_proto(sampling_params_to_proto(_params())).structured_output is None


def test_unknown_structured_output_kind_is_an_invalid_request() -> None:
    msg = sampling_params_to_proto(SamplingParams())
    msg.structured_output.CopyFrom(common_pb2.StructuredOutput(kind="yaml", value="x"))
    with pytest.raises(InvalidRequestError, match="yaml"):
        sampling_params_from_proto(msg)


def test_seed_zero_and_logprobs_zero_are_not_lost() -> None:
    p = SamplingParams(seed=0, logprobs=0, prompt_logprobs=0)
    back = sampling_params_from_proto(sampling_params_to_proto(p))
    assert back.seed == 0 and back.logprobs == 0 and back.prompt_logprobs == 0
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams())) == (
        SamplingParams()
    )


def test_detokenize_params_round_trip() -> None:
    p = DetokenizeParams(
        stop=("\n\n", "END"),
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )
    assert detokenize_params_from_proto(detokenize_params_to_proto(p)) == p


def test_scheduler_output_round_trip() -> None:
    out = SchedulerOutput(
        step_id=42,
        scheduled_new_reqs=[
            NewRequestData("a", [1, 2, 3], [], _params(), [4, 5], 0),
            NewRequestData("b", [7] * 40, [8, 9], SamplingParams(), [1, 2, 3], 32),
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["c", "d"], new_block_ids=[[], [17]], num_computed_tokens=[12, 31]
        ),
        num_scheduled_tokens={"a": 3, "b": 10, "c": 1, "d": 1},
        total_num_scheduled_tokens=15,
        finished_req_ids={"x", "y"},
    )
    assert scheduler_output_from_proto(scheduler_output_to_proto(out)) == out


def test_kv_cache_group_block_ids_round_trip() -> None:
    """Several KV-cache groups: groups 1..'s ids travel with each request."""
    out = SchedulerOutput(
        step_id=7,
        scheduled_new_reqs=[
            NewRequestData(
                "a", [1] * 9, [], SamplingParams(), [4, 5, 6], 0, group_block_ids=[[0, 8, 9]]
            ),
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["c", "d"],
            new_block_ids=[[], [17]],
            num_computed_tokens=[12, 31],
            new_group_block_ids=[[[]], [[21]]],
        ),
        num_scheduled_tokens={"a": 9, "c": 1, "d": 1},
        total_num_scheduled_tokens=11,
        finished_req_ids=set(),
    )
    assert scheduler_output_from_proto(scheduler_output_to_proto(out)) == out


def test_drafts_and_lora_round_trip() -> None:
    """Drafts travel parallel to scheduled_req_ids (empty rows for requests
    without any); a LoRA request survives the trip and None stays the base model."""
    lora = LoRARequest("sql", "ab" * 32, "/adapters/sql")
    out = SchedulerOutput(
        step_id=5,
        scheduled_new_reqs=[
            NewRequestData("a", [1, 2, 3], [], _params(), [4], 0, lora_request=lora),
            NewRequestData("b", [7, 8], [], SamplingParams(), [1], 0),
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["c"], new_block_ids=[[]], num_computed_tokens=[12]
        ),
        num_scheduled_tokens={"a": 3, "b": 2, "c": 4},
        total_num_scheduled_tokens=9,
        finished_req_ids=set(),
        scheduled_spec_decode_tokens={"c": [11, 12, 13]},
    )
    msg = scheduler_output_to_proto(out)
    assert [list(d.ids) for d in msg.spec_token_ids] == [[], [], [11, 12, 13]]
    assert scheduler_output_from_proto(msg) == out
    assert not scheduler_output_to_proto(SchedulerOutput.make_empty(1)).spec_token_ids


def test_connector_metadata_round_trip_and_empty_is_not_sent() -> None:
    out = SchedulerOutput.make_empty(step_id=3)
    assert not scheduler_output_to_proto(out).HasField("kv_connector_metadata")
    out.kv_connector_metadata = KVConnectorMetadata(
        loads=[KVTransfer("a", [4, 5], [b"\x01" * 32, b"\x02" * 32])],
        saves=[KVTransfer("b", [9], [b"\x03" * 32]), KVTransfer("c", [], [])],
    )
    msg = scheduler_output_to_proto(out)
    assert msg.HasField("kv_connector_metadata")
    assert scheduler_output_from_proto(msg) == out


def test_connector_output_round_trip_and_empty_is_not_sent() -> None:
    out = ModelRunnerOutput.make_empty(step_id=4)
    assert not model_runner_output_to_proto(out).HasField("kv_connector_output")
    out.kv_connector_output = KVConnectorOutput(
        finished_loads={"a": 2, "b": 0},
        saved_block_hashes=[b"\x07" * 32],
        failed_save_hashes=[b"\x08" * 32, b"\x09" * 32],
    )
    back = model_runner_output_from_proto(model_runner_output_to_proto(out))
    assert back.kv_connector_output == out.kv_connector_output


def test_model_runner_output_round_trip_with_mixed_logprobs() -> None:
    out = ModelRunnerOutput(
        step_id=7,
        req_ids=["a", "b", "c"],
        sampled_token_ids=[[5], [], [9]],
        logprobs=[[Logprobs(5, -0.5, 1, [5, 6], [-0.5, -1.5])], [], []],
        errors={"c": "boom"},
    )
    back = model_runner_output_from_proto(model_runner_output_to_proto(out))
    assert back.req_ids == out.req_ids
    assert back.sampled_token_ids == out.sampled_token_ids
    assert back.errors == out.errors
    assert back.logprobs == out.logprobs


def test_prompt_logprobs_round_trip() -> None:
    out = ModelRunnerOutput.make_empty(step_id=8)
    assert not model_runner_output_to_proto(out).prompt_logprobs
    out.prompt_logprobs = [
        PromptLogprobs(
            "a",
            1,
            [Logprobs(17, -2.5, 3, [4, 9], [-0.5, -1.0]), Logprobs(4, -0.5, 1, [4, 9], [-0.5, -1])],
        ),
        PromptLogprobs("b", 33, [Logprobs(8, -7.0, 120, [], [])]),
    ]
    back = model_runner_output_from_proto(model_runner_output_to_proto(out))
    assert back.prompt_logprobs == out.prompt_logprobs


def test_pooling_params_and_pooled_outputs_round_trip() -> None:
    from kvmesh.services.contracts.pooling_params import PoolingParams

    params = SamplingParams(
        max_tokens=1,
        pooling=PoolingParams(task="classify", normalize=False, first_segment_len=7),
    )
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params
    embed = SamplingParams(max_tokens=1, pooling=PoolingParams(dimensions=64))
    assert sampling_params_from_proto(sampling_params_to_proto(embed)) == embed
    out = ModelRunnerOutput.make_empty(3)
    out.pooled = {"a": b"\x00\x00\x80\x3f"}
    assert model_runner_output_from_proto(model_runner_output_to_proto(out)).pooled == out.pooled
