"""The names a client may put in ``model``: the base model and its LoRA adapters.

Like vLLM's ``OpenAIServingModels``: ``--lora-modules name=path`` registers
adapters at start, ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` change the set while serving. An adapter becomes a
``LoRARequest`` on each of its requests, named by content
(``kvmesh.services.contracts.lora_files.adapter_id``) so the scheduler's prefix cache and the
worker's slots key on what the adapter is, not on what it is called. Requests
already running keep the adapter they started with after an unload (the worker
holds it in a slot until it is evicted).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.services.contracts.errors import InvalidRequestError, NotFoundError
from kvmesh.services.contracts.lora_files import adapter_id, read_adapter_config
from kvmesh.services.contracts.lora_request import LoRARequest

logger = logging.getLogger(__name__)


def read_lora_request(name: str, path: str) -> LoRARequest:
    """Check an adapter folder and name it by content (reads the whole adapter: off the loop)."""
    folder = Path(path).expanduser().resolve()
    try:
        read_adapter_config(folder)
        lora_id = adapter_id(folder)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"Failed to load LoRA adapter {name!r}: {exc}") from exc
    return LoRARequest(lora_name=name, lora_id=lora_id, lora_path=str(folder))


@dataclass
class ServedModels:
    """The base model's name and, with ``--enable-lora``, the adapters by name."""

    base_model_name: str
    lora_enabled: bool = False
    adapters: dict[str, LoRARequest] = field(default_factory=dict)

    def resolve(self, requested: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model); NotFoundError for any other name.

        An absent model means the base model, as vLLM allows.
        """
        if requested is None or requested == self.base_model_name:
            return None
        lora = self.adapters.get(requested)
        if lora is None:
            raise NotFoundError(
                f"The model `{requested}` does not exist.", param="model", code="model_not_found"
            )
        return lora

    def check_new_name(self, name: str) -> None:
        """vLLM's refusals of a load, before any file is read."""
        if not self.lora_enabled:
            raise InvalidRequestError("LoRA adapters are not enabled (start with --enable-lora)")
        if name == self.base_model_name or name in self.adapters:
            raise InvalidRequestError(
                f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )

    def add(self, lora: LoRARequest) -> None:
        self.check_new_name(lora.lora_name)
        self.adapters[lora.lora_name] = lora
        logger.info("LoRA adapter %s served from %s", lora.lora_name, lora.lora_path)

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise NotFoundError(
                f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found"
            )
        logger.info("LoRA adapter %s no longer served", name)
