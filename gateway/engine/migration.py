"""Request migration, gateway side: a live request outlives its detokenizer and scheduler.

The gateway holds each request's client connection, so it is the one place
that knows what the client received (``gateway/engine/stream_cursor.py``) and can
rebuild the request elsewhere:

- Detokenizer restart: once subscribed again, the gateway asks the scheduler
  to republish its live requests (``Scheduler.ResyncRequests``); the new
  detokenizer replays each from its first token and the cursor forwards only
  what the client lacks.
- Scheduler restart (the detokenizer reports ``scheduler_lost``), or a request
  the scheduler no longer holds at a resync (its last output was lost): the
  gateway resubmits it as a continuation, the same request with the tokens
  the client received as ``resumed_output_token_ids``, to a scheduler that
  answers. The scheduler counts max_tokens, min_tokens and stops from the
  original start and advances a seeded request's generator past the resumed
  tokens, so greedy and seeded outputs equal the undisturbed run (seeded: on
  the same hardware and batch-invariant kernels; text-level state such as a
  stop string straddling the resume point is re-derived by the new
  detokenizer from the tokens, so it is kept too). Logprobs of tokens the
  client never received while the stage was down are not recomputed.
- ``--max-migrations`` continuations per request at most; past it the request
  fails with an error saying so.
"""

from __future__ import annotations

from prometheus_client import Counter

from kvmesh.protos import scheduler_pb2
from kvmesh.services.contracts.finish_reason import FinishReason

MIGRATIONS = Counter(
    "kvmesh:request_migrations",
    "live requests resumed after a stage was lost, by the stage (gateway: scheduler)",
    ["stage"],
)


def continuation_id(request_id: str, num_migrations: int) -> str:
    """The engine-side id of a request's ``num_migrations``-th continuation.

    A new id: a scheduler that was only cut off (not dead) may still hold the
    old one until the gateway's abort of it lands.
    """
    return request_id if num_migrations == 0 else f"{request_id}~m{num_migrations}"


def continuation_of(
    first: scheduler_pb2.AddRequestRequest, delivered: list[int], num_migrations: int
) -> scheduler_pb2.AddRequestRequest:
    """The AddRequest that resumes ``first`` after ``delivered`` output tokens."""
    msg = scheduler_pb2.AddRequestRequest()
    msg.CopyFrom(first)
    msg.request_id = continuation_id(first.request_id, num_migrations)
    msg.resumed_output_token_ids[:] = delivered
    msg.num_migrations = num_migrations
    # The prefill replica's KV leases were spent on the first submission.
    msg.ClearField("kv_transfer")
    return msg


def finish_reason_of_delivered(
    first: scheduler_pb2.AddRequestRequest,
    delivered: list[int],
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
) -> str | None:
    """Whether the tokens delivered already end the request (its last output was
    lost): "length" or "stop", else None (there is more to generate)."""
    params = first.sampling_params
    if len(delivered) >= params.max_tokens:
        return FinishReason.LENGTH.value
    if len(first.prompt_token_ids) + len(delivered) >= max_model_len:
        return FinishReason.LENGTH.value
    if delivered and len(delivered) >= params.min_tokens:
        last = delivered[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
            return FinishReason.STOP.value
    return None
