"""When a request stops, decided after each appended token."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.request_status import RequestStatus

if TYPE_CHECKING:
    # Request calls check_stop after each appended token (Request.append_output_token_ids).
    from scheduler.request import Request


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status and return True if its last token ends it.

    EOS and stop tokens win over length when both apply to the same token (the
    model did stop). Neither counts before ``min_tokens`` outputs.
    """
    params = request.sampling_params
    num_output_tokens = len(request.output_token_ids)
    if num_output_tokens >= params.min_tokens:
        last_token_id = request.output_token_ids[-1]
        if last_token_id in request.eos_token_ids and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    if num_output_tokens >= params.max_tokens or len(request.all_token_ids) >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
