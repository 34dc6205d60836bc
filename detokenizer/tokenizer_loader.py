"""Load a fast tokenizer from a Hugging Face model folder."""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Read ``tokenizer.json`` from ``model_dir``.

    Raises ``FileNotFoundError`` when the folder has no ``tokenizer.json``.
    """
    model_dir = Path(model_dir)
    tokenizer_path = model_dir / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {model_dir}")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    logger.info(
        "loaded tokenizer from %s: vocab %s",
        model_dir,
        tokenizer.get_vocab_size(with_added_tokens=True),
    )
    return tokenizer
