"""The gateway's tokenizer: encode, decode, special ids and the model's own chat template.

Loaded from a Hugging Face model folder with the class ``AutoTokenizer`` would
pick, so chat templates render exactly as transformers renders them (sandboxed
Jinja, ``raise_exception``, ``tojson``, special-token variables). Encoding and
decoding go straight to the underlying ``tokenizers.Tokenizer``, which skips
transformers' per-call Python overhead.

Importing ``AutoTokenizer`` pulls in transformers' model configuration code and
with it torch, which the gateway never runs. A Llama folder that declares the
generic tokenizers backend (as transformers 5 saves one, the default model
included) is loaded with that class directly: the same class AutoTokenizer
picks, without torch in the process (on the default model and the 2-core AMX Xeon dev box:
RSS 155 vs 290 MB, a stack ready in ~11 s vs ~13.7 s). Every
other folder goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import transformers

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (bad role order, missing field...)."""


class Tokenizer:
    """A model's tokenizer as the gateway uses it."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self._hf = hf_tokenizer
        self._fast = hf_tokenizer.backend_tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size: int = len(hf_tokenizer)
        # Tokenizing and rendering chat templates is CPU work (a long prompt:
        # milliseconds; a template: pure-Python Jinja) that would stall every
        # stream of the gateway's event loop; one thread does it, in order,
        # so the tokenizer is never used by two threads at once.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> Tokenizer:
        model_path = Path(model_path)
        hf_tokenizer = _tokenizer_class(model_path).from_pretrained(str(model_path))
        eos_ids = _collect_eos_token_ids(model_path, hf_tokenizer.eos_token_id)
        logger.info(
            "loaded tokenizer from %s: vocab %s, eos %s, chat template %s",
            model_path,
            len(hf_tokenizer),
            eos_ids,
            "yes" if hf_tokenizer.chat_template else "no",
        )
        return cls(hf_tokenizer, eos_ids)

    async def offload(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on the tokenizer's thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._hf.all_special_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._hf.chat_template)

    @property
    def chat_template_source(self) -> str | None:
        """The Jinja source of the chat template used for chats (all of them, if several)."""
        template = self._hf.chat_template
        if isinstance(template, dict):
            return "\n".join(str(source) for source in template.values())
        return template or None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._fast.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_text(self, token_id: int) -> str:
        """One token decoded on its own, as it appears in logprobs."""
        return self._fast.decode([token_id], skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (e.g. ``Ġworld``), not its decoded text."""
        return self._fast.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's own template; raises ChatTemplateError."""
        if not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            rendered = self._hf.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **template_kwargs,
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc
        if not isinstance(rendered, str):  # a batch was passed; the gateway never does
            raise ChatTemplateError("chat template did not render to a single string")
        return rendered


def _tokenizer_class(model_path: Path) -> Any:
    """The class ``AutoTokenizer`` resolves for this folder, without importing torch
    where that class is known without asking ``AutoTokenizer``."""
    if _declares_the_generic_backend(model_path):
        return transformers.TokenizersBackend
    from transformers import AutoTokenizer  # imports torch: only for folders that need it

    return AutoTokenizer


# Tokenizer classes that mean "tokenizer.json as it is" (transformers 5 saves
# TokenizersBackend). For a Llama model declaring one of them, with no custom
# code, AutoTokenizer returns TokenizersBackend too; other model types may be
# mapped to their own class (Qwen2 is), so they go through AutoTokenizer.
_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
_GENERIC_BACKEND_MODEL_TYPES = frozenset({"llama"})


def _declares_the_generic_backend(model_path: Path) -> bool:
    try:
        tokenizer_config = json.loads((model_path / "tokenizer_config.json").read_text())
        model_config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        tokenizer_config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
        and "auto_map" not in tokenizer_config
        and model_config.get("model_type") in _GENERIC_BACKEND_MODEL_TYPES
        and (model_path / "tokenizer.json").exists()
    )


def _collect_eos_token_ids(model_path: Path, tokenizer_eos: int | None) -> tuple[int, ...]:
    # generation_config.json may list several end-of-turn ids (Llama 3 does).
    ids: list[int] = [] if tokenizer_eos is None else [tokenizer_eos]
    config_file = model_path / "generation_config.json"
    if config_file.exists():
        configured = json.loads(config_file.read_text()).get("eos_token_id")
        if isinstance(configured, int):
            configured = [configured]
        for token_id in configured or []:
            if token_id not in ids:
                ids.append(token_id)
    return tuple(ids)
