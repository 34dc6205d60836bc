"""The detokenizer's part of each request's trace (services/runtime/tracing.py).

The scheduler's output stream carries every request, so a request's context
arrives in its ``RequestHeader.trace_context`` (on its first output). Per
traced request the detokenizer keeps one ``detokenizer.request`` span, child
of the scheduler's span of the request, from its first output to its last,
which records how it ended (finish reason, output tokens, stop string).
"""

from __future__ import annotations

from kvmesh.protos import common_pb2, detokenizer_pb2, scheduler_pb2
from kvmesh.services.runtime.tracing import RequestSpans, Tracing


class DetokenizerRequestTraces:
    def __init__(self, tracing: Tracing) -> None:
        self._spans = RequestSpans(tracing, "detokenizer.request")

    def __len__(self) -> int:
        return len(self._spans)

    def on_header(self, request_id: str, header: scheduler_pb2.RequestHeader) -> None:
        if header.trace_context:
            self._spans.start(request_id, Tracing.parent(header.trace_context))

    def on_finished(self, output: detokenizer_pb2.DetokenizedOutput) -> None:
        attributes: dict[str, str | int] = {
            "kvmesh.finish_reason": common_pb2.FinishReason.Name(output.finish_reason),
            "kvmesh.num_output_tokens": output.num_output_tokens,
        }
        if output.HasField("stop_string"):
            attributes["kvmesh.stop_string"] = output.stop_string
        self._spans.end(output.request_id, attributes)

    def on_stream_lost(self) -> None:
        """The scheduler's stream broke: every live request failed with it."""
        self._spans.end_all("scheduler stream lost")
