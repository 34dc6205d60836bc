"""The detokenizer's span of a traced request: under the scheduler's span, first output to last."""

from __future__ import annotations

from tokenizers import Tokenizer

from kvmesh.detokenizer.registry import DetokenizerTable
from kvmesh.detokenizer.request_tracing import DetokenizerRequestTraces
from kvmesh.detokenizer.service import DetokenizerEngine
from kvmesh.protos import common_pb2, scheduler_pb2
from kvmesh.services.runtime.tracing import Tracing
from tests.services.tracing_helpers import memory_tracing, only_span


def _output(rid: str, token: int, **fields) -> scheduler_pb2.RequestOutput:
    return scheduler_pb2.RequestOutput(request_id=rid, new_token_ids=[token], **fields)


def test_a_traced_request_is_one_span_ended_by_its_last_output(tokenizer: Tokenizer) -> None:
    tracing, exporter = memory_tracing("detokenizer")
    engine = DetokenizerEngine(
        DetokenizerTable(tokenizer), "unused:0", traces=DetokenizerRequestTraces(tracing)
    )
    prompt = tokenizer.encode("Say it").ids
    word = tokenizer.encode(" hello").ids[0]
    with tracing.span("kvmesh.scheduler.request") as upstream:
        carrier = Tracing.carrier(upstream)
    header = scheduler_pb2.RequestHeader(
        prompt_token_ids=prompt, client_id="gw", trace_context=carrier
    )
    untraced = scheduler_pb2.RequestHeader(prompt_token_ids=prompt, client_id="gw")
    engine.process_step(
        scheduler_pb2.StepOutputs(
            outputs=[_output("t", word, header=header), _output("u", word, header=untraced)]
        )
    )
    assert len(engine.traces) == 1
    last = common_pb2.FINISH_REASON_LENGTH
    engine.process_step(
        scheduler_pb2.StepOutputs(
            outputs=[_output("t", word, finish_reason=last), _output("u", word, finish_reason=last)]
        )
    )
    span = only_span(exporter, "detokenizer.request")
    assert span.parent.span_id == upstream.get_span_context().span_id
    assert span.attributes["kvmesh.request_id"] == "t"
    assert span.attributes["kvmesh.finish_reason"] == "FINISH_REASON_LENGTH"
    assert span.attributes["kvmesh.num_output_tokens"] == 2
    assert len(engine.traces) == 0
