"""kvmesh.gateway.tokenizer against transformers on the real SmolLM2 tokenizer."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from kvmesh.gateway.openai.app import build_app
from kvmesh.gateway.tokenizer import ChatTemplateError, Tokenizer, _tokenizer_class
from kvmesh.services.cli.local_stack import REPO_ROOT
from kvmesh.services.runtime.model_prep import default_model_path
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL_NAME


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer: Tokenizer) -> Any:
    return AutoTokenizer.from_pretrained(str(default_model_path()))


def test_special_ids_match_the_model(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id
    assert 2 in tokenizer.eos_token_ids
    assert tokenizer.vocab_size == len(hf_tokenizer)
    assert set(tokenizer.all_special_ids) == set(hf_tokenizer.all_special_ids)


@pytest.mark.parametrize(
    "text", ["Hello, world!", "  leading spaces", "ünïcödé 日本語 🙂", "a\n\nb"]
)
def test_encode_decode_match_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_decode_keeps_or_skips_special_tokens(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("hi"), tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"


def test_chat_template_with_tools_matches_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather?"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    theirs = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tools=tools, tokenize=False
    )
    assert ours == theirs
    without_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert ours.startswith(without_prompt) and ours != without_prompt


async def test_template_exceptions_become_400_on_messages(
    tokenizer: Tokenizer, engine: FakeEngineClient
) -> None:
    strict_hf = copy.deepcopy(tokenizer._hf)
    strict_hf.chat_template = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('the first message must be a system message') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    strict = Tokenizer(strict_hf, tokenizer.eos_token_ids)
    with pytest.raises(ChatTemplateError):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])
    app = build_app(engine, strict, MODEL_NAME, metrics_registry=CollectorRegistry())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        response = await http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert "first message must be a system message" in error["message"]
    assert engine.requests == []


@pytest.mark.parametrize(
    ("tokenizer_class", "model_type", "without_torch"),
    [
        ("TokenizersBackend", "llama", True),
        ("PreTrainedTokenizerFast", "llama", True),
        ("TokenizersBackend", "qwen2", False),  # AutoTokenizer maps qwen2 to its own class
        ("LlamaTokenizerFast", "llama", False),
        (None, "llama", False),
    ],
)
def test_the_class_is_the_one_auto_tokenizer_picks(
    tmp_path: Path, tokenizer_class: str | None, model_type: str, without_torch: bool
) -> None:
    for source in default_model_path().iterdir():
        if source.name.startswith("tokenizer") or source.suffix == ".jinja":
            shutil.copy(source, tmp_path / source.name)
    config = json.loads((default_model_path() / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokenizer_config.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        tokenizer_config["tokenizer_class"] = tokenizer_class
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))

    picked = _tokenizer_class(tmp_path)
    assert (picked is not AutoTokenizer) == without_torch
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_pretrained(tmp_path)
    assert type(ours._hf) is type(reference)
    assert ours.encode("Hello, wörld!  x") == reference.encode("Hello, wörld!  x")


def test_the_gateway_never_imports_torch() -> None:
    """The gateway runs no tensor: on the default model its process stays without
    torch (~135 MB and 2-3 s of start-up less)."""
    script = (
        "import sys\n"
        "import kvmesh.gateway.server\n"
        "from kvmesh.gateway.tokenizer import Tokenizer\n"
        "from kvmesh.services.runtime.model_prep import default_model_path\n"
        "Tokenizer.from_pretrained(default_model_path()).apply_chat_template(\n"
        "    [{'role': 'user', 'content': 'hi'}])\n"
        "assert 'torch' not in sys.modules, 'the gateway imported torch'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
