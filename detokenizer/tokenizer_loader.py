"""Load a fast tokenizer from a Hugging Face model folder."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer plus the facts about its vocabulary the detokenizer needs."""

    tokenizer: Tokenizer
    # Ids of added tokens marked special (skipped by skip_special_tokens).
    special_token_ids: frozenset[int]
    # Vocabulary size including added tokens: every valid id is below it.
    vocab_size: int
    eos_token_id: int | None
    bos_token_id: int | None

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_token_ids


def load_tokenizer(model_dir: str | Path) -> LoadedTokenizer:
    """Read ``tokenizer.json`` (and ``tokenizer_config.json`` if present) from ``model_dir``.

    Raises ``FileNotFoundError`` when the folder has no ``tokenizer.json``.
    """
    model_dir = Path(model_dir)
    tokenizer_path = model_dir / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {model_dir}")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    special_ids = frozenset(
        token_id
        for token_id, added in tokenizer.get_added_tokens_decoder().items()
        if added.special
    )
    config = _read_tokenizer_config(model_dir / TOKENIZER_CONFIG_FILE)
    loaded = LoadedTokenizer(
        tokenizer=tokenizer,
        special_token_ids=special_ids,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        eos_token_id=_token_id(tokenizer, config.get("eos_token")),
        bos_token_id=_token_id(tokenizer, config.get("bos_token")),
    )
    logger.info(
        "loaded tokenizer from %s: vocab %s, %s special tokens, eos %s",
        model_dir,
        loaded.vocab_size,
        len(special_ids),
        loaded.eos_token_id,
    )
    return loaded


def _read_tokenizer_config(path: Path) -> dict[str, object]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        config = json.load(f)
    return config if isinstance(config, dict) else {}


def _token_id(tokenizer: Tokenizer, token: object) -> int | None:
    # tokenizer_config.json spells a token either as a string or as an
    # AddedToken-like dict with a "content" field.
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return tokenizer.token_to_id(token)
