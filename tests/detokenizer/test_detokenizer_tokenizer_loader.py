from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.detokenizer.tokenizer_loader import load_tokenizer


def test_loads_default_model_tokenizer(model_dir: Path) -> None:
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 49152
    assert tokenizer.decode(tokenizer.encode("Hello, world!").ids) == "Hello, world!"


def test_missing_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_tokenizer_json_alone_is_enough(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    assert load_tokenizer(tmp_path).get_vocab_size(with_added_tokens=True) == 49152
