"""The request-size and request-cost limits one gateway enforces, taken from its config."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.services.runtime.config import GatewayConfig

_DEFAULTS = GatewayConfig()


@dataclass(frozen=True)
class GatewayLimits:
    """What one call may ask for; defaults are the config's (gateway/request_cost.py
    enforces the last three)."""

    max_request_body_bytes: int = _DEFAULTS.max_request_body_bytes
    max_prompts_per_request: int = _DEFAULTS.max_prompts_per_request
    max_n: int = _DEFAULTS.max_n
    # 0: only the context length bounds max_tokens.
    max_tokens_limit: int = _DEFAULTS.max_tokens_limit
    max_tokens_per_request: int = _DEFAULTS.max_tokens_per_request

    @classmethod
    def from_config(cls, config: GatewayConfig) -> GatewayLimits:
        return cls(
            max_request_body_bytes=config.max_request_body_bytes,
            max_prompts_per_request=config.max_prompts_per_request,
            max_n=config.max_n,
            max_tokens_limit=config.max_tokens_limit,
            max_tokens_per_request=config.max_tokens_per_request,
        )

    def max_output_len(self, max_model_len: int) -> int:
        """The largest max_tokens any choice may ask for on this server."""
        room = max_model_len - 1
        return min(room, self.max_tokens_limit) if self.max_tokens_limit else room
