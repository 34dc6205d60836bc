"""The request-size limits one gateway enforces, taken from its config."""

from __future__ import annotations

from dataclasses import dataclass

from services.config import GatewayConfig

_DEFAULTS = GatewayConfig()


@dataclass(frozen=True)
class GatewayLimits:
    """What one call may ask for; defaults are the config's."""

    max_request_body_bytes: int = _DEFAULTS.max_request_body_bytes
    max_prompts_per_request: int = _DEFAULTS.max_prompts_per_request

    @classmethod
    def from_config(cls, config: GatewayConfig) -> GatewayLimits:
        return cls(
            max_request_body_bytes=config.max_request_body_bytes,
            max_prompts_per_request=config.max_prompts_per_request,
        )
