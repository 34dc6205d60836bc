from __future__ import annotations

from pathlib import Path

import pytest

from detokenizer.tokenizer_loader import load_tokenizer


def test_loads_default_model_tokenizer(model_dir: Path) -> None:
    loaded = load_tokenizer(model_dir)
    assert loaded.vocab_size == 49152
    assert loaded.eos_token_id == 2 and loaded.bos_token_id == 1
    assert loaded.is_special(2) and not loaded.is_special(loaded.tokenizer.token_to_id("Hello"))
    # Exactly the special ids vanish under skip_special_tokens.
    tokenizer = loaded.tokenizer
    for token_id in range(64):
        vanishes = tokenizer.decode([token_id], skip_special_tokens=True) == ""
        assert vanishes == loaded.is_special(token_id), token_id


def test_missing_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_config_without_special_token_names(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_token_id is None and loaded.vocab_size == 49152
