"""Convert the in-process step contract (kvmesh.services.contracts.step) to protobuf and back.

Kept in one place so the scheduler and worker services stay thin and the
wire format has exactly one definition. Token ids travel as packed
``repeated int32``; only deltas travel for requests the worker already holds.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.protos import common_pb2, worker_pb2
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.contracts.lora_request import LoRARequest
from kvmesh.services.contracts.pooling_params import PoolingParams
from kvmesh.services.contracts.sampling_params import (
    STRUCTURED_OUTPUT_KINDS,
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


def sampling_params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        top_n_sigma=p.top_n_sigma,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        stop_token_ids=p.stop_token_ids,
        logit_bias_token_ids=[t for t, _ in p.logit_bias],
        logit_bias_values=[b for _, b in p.logit_bias],
        allowed_token_ids=p.allowed_token_ids,
        bad_words=[common_pb2.TokenSequence(token_ids=word) for word in p.bad_words_token_ids],
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.structured_output is not None:
        msg.structured_output.CopyFrom(structured_output_to_proto(p.structured_output))
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.pooling is not None:
        msg.pooling.CopyFrom(pooling_params_to_proto(p.pooling))
    return msg


def pooling_params_to_proto(p: PoolingParams) -> common_pb2.PoolingParams:
    msg = common_pb2.PoolingParams(task=p.task)
    if p.dimensions is not None:
        msg.dimensions = p.dimensions
    if p.normalize is not None:
        msg.normalize = p.normalize
    if p.first_segment_len is not None:
        msg.first_segment_len = p.first_segment_len
    return msg


def pooling_params_from_proto(msg: common_pb2.PoolingParams) -> PoolingParams:
    """InvalidRequestError for an unknown task or a non-positive dimension."""
    try:
        return PoolingParams(
            task=msg.task,  # type: ignore[arg-type]
            dimensions=msg.dimensions if msg.HasField("dimensions") else None,
            normalize=msg.normalize if msg.HasField("normalize") else None,
            first_segment_len=(
                msg.first_segment_len if msg.HasField("first_segment_len") else None
            ),
        )
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc


def structured_output_to_proto(spec: StructuredOutputSpec) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(
        kind=spec.kind, value=spec.value, reasoning_end_token_ids=spec.reasoning_end_token_ids
    )


def structured_output_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutputSpec:
    """InvalidRequestError for an unknown kind: the caller named a constraint nobody compiles."""
    if msg.kind not in STRUCTURED_OUTPUT_KINDS:
        expected = ", ".join(STRUCTURED_OUTPUT_KINDS)
        raise InvalidRequestError(
            f"unknown structured output kind {msg.kind!r}; expected one of {expected}"
        )
    return StructuredOutputSpec(
        kind=msg.kind,  # type: ignore[arg-type]
        value=msg.value,
        reasoning_end_token_ids=tuple(msg.reasoning_end_token_ids),
    )


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        top_n_sigma=msg.top_n_sigma,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty,
        min_tokens=msg.min_tokens,
        ignore_eos=msg.ignore_eos,
        stop_token_ids=tuple(msg.stop_token_ids),
        logit_bias=tuple(zip(msg.logit_bias_token_ids, msg.logit_bias_values, strict=True)),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        structured_output=(
            structured_output_from_proto(msg.structured_output)
            if msg.HasField("structured_output")
            else None
        ),
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        allowed_token_ids=tuple(msg.allowed_token_ids),
        bad_words_token_ids=tuple(tuple(word.token_ids) for word in msg.bad_words),
        pooling=pooling_params_from_proto(msg.pooling) if msg.HasField("pooling") else None,
    )


def detokenize_params_to_proto(p: DetokenizeParams) -> common_pb2.DetokenizeParams:
    return common_pb2.DetokenizeParams(
        stop=list(p.stop),
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
    )


def detokenize_params_from_proto(msg: common_pb2.DetokenizeParams) -> DetokenizeParams:
    return DetokenizeParams(
        stop=tuple(msg.stop),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=msg.skip_special_tokens,
        spaces_between_special_tokens=msg.spaces_between_special_tokens,
    )


def logprobs_to_proto(lp: Logprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top_token_ids=lp.top_token_ids,
        top_logprobs=lp.top_logprobs,
    )


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> Logprobs:
    return Logprobs(
        token_id=msg.token_id,
        logprob=msg.logprob,
        rank=msg.rank,
        top_token_ids=list(msg.top_token_ids),
        top_logprobs=list(msg.top_logprobs),
    )


def prompt_logprobs_to_proto(run: PromptLogprobs) -> worker_pb2.PromptLogprobs:
    return worker_pb2.PromptLogprobs(
        req_id=run.req_id,
        start_position=run.start_position,
        logprobs=[logprobs_to_proto(lp) for lp in run.entries],
    )


def prompt_logprobs_from_proto(msg: worker_pb2.PromptLogprobs) -> PromptLogprobs:
    return PromptLogprobs(
        req_id=msg.req_id,
        start_position=msg.start_position,
        entries=[logprobs_from_proto(lp) for lp in msg.logprobs],
    )


def _transfers_to_proto(transfers: list[KVTransfer]) -> list[worker_pb2.KVTransfer]:
    return [
        worker_pb2.KVTransfer(req_id=t.req_id, block_ids=t.block_ids, block_hashes=t.block_hashes)
        for t in transfers
    ]


def _transfers_from_proto(msgs: Iterable[worker_pb2.KVTransfer]) -> list[KVTransfer]:
    return [KVTransfer(m.req_id, list(m.block_ids), list(m.block_hashes)) for m in msgs]


def kv_connector_metadata_to_proto(meta: KVConnectorMetadata) -> worker_pb2.KVConnectorMetadata:
    return worker_pb2.KVConnectorMetadata(
        loads=_transfers_to_proto(meta.loads), saves=_transfers_to_proto(meta.saves)
    )


def kv_connector_metadata_from_proto(msg: worker_pb2.KVConnectorMetadata) -> KVConnectorMetadata:
    return KVConnectorMetadata(
        loads=_transfers_from_proto(msg.loads), saves=_transfers_from_proto(msg.saves)
    )


def kv_connector_output_to_proto(out: KVConnectorOutput) -> worker_pb2.KVConnectorOutput:
    return worker_pb2.KVConnectorOutput(
        finished_loads=[
            worker_pb2.KVLoadResult(req_id=r, num_loaded_blocks=n)
            for r, n in out.finished_loads.items()
        ],
        saved_block_hashes=out.saved_block_hashes,
        failed_save_hashes=out.failed_save_hashes,
    )


def kv_connector_output_from_proto(msg: worker_pb2.KVConnectorOutput) -> KVConnectorOutput:
    return KVConnectorOutput(
        finished_loads={r.req_id: r.num_loaded_blocks for r in msg.finished_loads},
        saved_block_hashes=list(msg.saved_block_hashes),
        failed_save_hashes=list(msg.failed_save_hashes),
    )


def lora_request_to_proto(lora: LoRARequest | None) -> common_pb2.LoRARequest | None:
    if lora is None:
        return None
    return common_pb2.LoRARequest(
        lora_name=lora.lora_name, lora_id=lora.lora_id, lora_path=lora.lora_path
    )


def lora_request_from_proto(msg: common_pb2.LoRARequest) -> LoRARequest | None:
    """None for an unset message (the base model)."""
    if not msg.lora_id:
        return None
    return LoRARequest(lora_name=msg.lora_name, lora_id=msg.lora_id, lora_path=msg.lora_path)


def scheduler_output_to_proto(out: SchedulerOutput) -> worker_pb2.StepRequest:
    cached = out.scheduled_cached_reqs
    return worker_pb2.StepRequest(
        step_id=out.step_id,
        new_requests=[
            worker_pb2.NewRequest(
                req_id=r.req_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                sampling_params=sampling_params_to_proto(r.sampling_params),
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                lora_request=lora_request_to_proto(r.lora_request),
                trace_context=r.trace_context,
                group_block_ids=[worker_pb2.BlockIds(ids=b) for b in r.group_block_ids],
            )
            for r in out.scheduled_new_reqs
        ],
        cached_requests=worker_pb2.CachedRequests(
            req_ids=cached.req_ids,
            new_block_ids=[worker_pb2.BlockIds(ids=b) for b in cached.new_block_ids],
            num_computed_tokens=cached.num_computed_tokens,
            new_group_block_ids=[
                worker_pb2.GroupBlockIds(groups=[worker_pb2.BlockIds(ids=b) for b in groups])
                for groups in cached.new_group_block_ids
            ],
        ),
        scheduled_req_ids=list(out.num_scheduled_tokens.keys()),
        num_scheduled_tokens=list(out.num_scheduled_tokens.values()),
        finished_req_ids=sorted(out.finished_req_ids),
        kv_connector_metadata=(
            None
            if out.kv_connector_metadata.is_empty()
            else kv_connector_metadata_to_proto(out.kv_connector_metadata)
        ),
        spec_token_ids=(
            [worker_pb2.BlockIds(ids=spec.get(req_id, ())) for req_id in out.num_scheduled_tokens]
            if (spec := out.scheduled_spec_decode_tokens)
            else []
        ),
    )


def scheduler_output_from_proto(msg: worker_pb2.StepRequest) -> SchedulerOutput:
    num_scheduled = dict(zip(msg.scheduled_req_ids, msg.num_scheduled_tokens, strict=True))
    cached = msg.cached_requests
    return SchedulerOutput(
        step_id=msg.step_id,
        scheduled_new_reqs=[
            NewRequestData(
                req_id=r.req_id,
                prompt_token_ids=list(r.prompt_token_ids),
                output_token_ids=list(r.output_token_ids),
                sampling_params=sampling_params_from_proto(r.sampling_params),
                block_ids=list(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                lora_request=lora_request_from_proto(r.lora_request),
                trace_context=dict(r.trace_context),
                group_block_ids=[list(b.ids) for b in r.group_block_ids],
            )
            for r in msg.new_requests
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=list(cached.req_ids),
            new_block_ids=[list(b.ids) for b in cached.new_block_ids],
            num_computed_tokens=list(cached.num_computed_tokens),
            new_group_block_ids=[
                [list(b.ids) for b in groups.groups] for groups in cached.new_group_block_ids
            ],
        ),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=set(msg.finished_req_ids),
        kv_connector_metadata=kv_connector_metadata_from_proto(msg.kv_connector_metadata),
        scheduled_spec_decode_tokens=(
            {
                req_id: list(spec.ids)
                for req_id, spec in zip(msg.scheduled_req_ids, msg.spec_token_ids, strict=True)
                if spec.ids
            }
            if msg.spec_token_ids
            else {}
        ),
    )


def model_runner_output_to_proto(
    out: ModelRunnerOutput, execute_seconds: float = 0.0
) -> worker_pb2.StepResult:
    return worker_pb2.StepResult(
        step_id=out.step_id,
        req_ids=out.req_ids,
        sampled_token_ids=[worker_pb2.BlockIds(ids=t) for t in out.sampled_token_ids],
        logprobs=(
            [
                worker_pb2.TokenLogprobsList(entries=[logprobs_to_proto(lp) for lp in run])
                for run in out.logprobs
            ]
            if any(out.logprobs)
            else []
        ),
        errors=out.errors,
        execute_seconds=execute_seconds,
        kv_connector_output=(
            None
            if out.kv_connector_output.is_empty()
            else kv_connector_output_to_proto(out.kv_connector_output)
        ),
        prompt_logprobs=[prompt_logprobs_to_proto(run) for run in out.prompt_logprobs],
        pooled=out.pooled,
    )


def model_runner_output_from_proto(msg: worker_pb2.StepResult) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        step_id=msg.step_id,
        req_ids=list(msg.req_ids),
        sampled_token_ids=[list(t.ids) for t in msg.sampled_token_ids],
        logprobs=[[logprobs_from_proto(lp) for lp in run.entries] for run in msg.logprobs],
        errors=dict(msg.errors),
        kv_connector_output=kv_connector_output_from_proto(msg.kv_connector_output),
        prompt_logprobs=[prompt_logprobs_from_proto(run) for run in msg.prompt_logprobs],
        pooled=dict(msg.pooled),
    )
