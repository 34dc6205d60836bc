from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kvmesh.services.runtime.model_prep import default_model_path


@pytest.fixture(scope="session")
def model_dir() -> Path:
    path = default_model_path()
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"default model tokenizer not prepared at {path}")
    return path


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))
