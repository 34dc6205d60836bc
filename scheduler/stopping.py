"""When a request stops, decided after each appended token.

A pure decision over what the request holds; ``Request`` applies it to its
own state (so this module needs no ``Request`` and the two import one way).
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from kvmesh.scheduler.request_status import RequestStatus
from kvmesh.services.contracts.sampling_params import SamplingParams

# The verdict: the finished status and, for a stop_token_ids match, that token.
Stop = tuple[RequestStatus, int | None]


def check_stop(
    params: SamplingParams,
    output_token_ids: Sequence[int],
    num_tokens: int,
    eos_token_ids: Set[int],
    max_model_len: int,
) -> Stop | None:
    """How the request's last token ends it, or None if it goes on.

    ``num_tokens`` counts prompt and output. EOS and stop tokens win over
    length when both apply to the same token (the model did stop). Neither
    counts before ``min_tokens`` outputs.
    """
    num_output_tokens = len(output_token_ids)
    if num_output_tokens >= params.min_tokens:
        last_token_id = output_token_ids[-1]
        if last_token_id in eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED, None
        if params.stop_token_ids and last_token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, last_token_id
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    return None
