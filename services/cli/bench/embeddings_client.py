"""``kvmesh bench``'s embedding workload: ``POST /v1/embeddings`` with a batch of
inputs per request, timed end to end (vllm bench serve's openai-embeddings backend).

An embedding request answers once, not as a stream: its TTFT and its
end-to-end latency are the same time, it has no inter-token gaps and no
output tokens. Each benchmark request carries ``inputs_per_request`` of the
dataset's prompts (the OpenAI ``input`` list).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvmesh.services.cli.bench.client import CompletionsClient, RequestOutput
from kvmesh.services.cli.bench.dataset import SampleRequest

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 1000


def is_embeddings_endpoint(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("/embeddings")


def group_requests(requests: Sequence[SampleRequest], size: int) -> list[SampleRequest]:
    """Consecutive prompts ``size`` at a time, one request each (the last may be short)."""
    if size < 1:
        raise ValueError(f"--inputs-per-request must be >= 1, got {size}")
    grouped = []
    for start in range(0, len(requests), size):
        group = requests[start : start + size]
        grouped.append(
            SampleRequest(
                request_id=f"bench-embed-{start // size}",
                prompt=[r.prompt for r in group],  # type: ignore[misc]
                prompt_len=sum(r.prompt_len for r in group),
                output_len=len(group),  # inputs in this request (no tokens are generated)
            )
        )
    return grouped


class EmbeddingsClient(CompletionsClient):
    """Sends each request's inputs to the embeddings endpoint in one POST."""

    def payload(self, request: SampleRequest) -> dict[str, Any]:
        return {"model": self.config.model, "input": request.prompt, "encoding_format": "base64"}

    async def send(self, request: SampleRequest) -> RequestOutput:
        """One embeddings call; never raises: failures come back as ``success=False``."""
        output = RequestOutput(request_id=request.request_id, prompt_len=request.prompt_len)
        start = time.perf_counter()
        output.start_time = start
        try:
            response = await self._http.post(
                self.config.url,
                json=self.payload(request),
                headers={"x-request-id": request.request_id},
            )
            if response.status_code != 200:
                output.error = f"HTTP {response.status_code}: {response.text[:_MAX_ERROR_CHARS]}"
                return output
            body = response.json()
        except Exception as exc:
            output.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
            logger.debug("request %s failed", request.request_id, exc_info=True)
            return output
        if len(body.get("data") or []) != len(request.prompt):
            output.error = (
                f"{len(body.get('data') or [])} embeddings for {len(request.prompt)} inputs"
            )
            return output
        output.latency = output.ttft = time.perf_counter() - start
        usage = body.get("usage") or {}
        if usage.get("prompt_tokens") is not None:
            output.prompt_len = int(usage["prompt_tokens"])
        output.success = True
        return output
