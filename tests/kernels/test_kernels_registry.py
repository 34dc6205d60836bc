"""Backend selection: the right backend per device, overrides, and reasons for refusals."""

from __future__ import annotations

import pytest
import torch

from kernels.registry import BACKENDS, explain_backend_choice, select_attention_backend


def test_cpu_device_gets_the_fast_cpu_backend() -> None:
    assert select_attention_backend(torch.device("cpu")).name == "cpu"


@pytest.mark.parametrize("name", ["torch_reference", "cpu"])
def test_preferred_backend_is_forced(name: str) -> None:
    assert select_attention_backend(torch.device("cpu"), preferred=name).name == name


def test_triton_on_cpu_without_interpreter_is_refused_with_a_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    lines = explain_backend_choice(torch.device("cpu"), preferred="triton")
    refusal = next(line for line in lines if line.startswith("triton:"))
    assert "refused" in refusal and "not CUDA" in refusal and "TRITON_INTERPRET" in refusal
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_attention_backend(torch.device("cpu"), preferred="triton")


def test_unknown_preferred_backend_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="torch_reference"):
        select_attention_backend("cpu", preferred="flashinfer")


def test_explanation_covers_every_backend() -> None:
    lines = explain_backend_choice(torch.device("cpu"))
    assert {line.split(":")[0] for line in lines} == set(BACKENDS)
    assert lines[0] == "cpu: chosen for device cpu (first supported)"


def test_cuda_device_prefers_triton_when_available() -> None:
    lines = explain_backend_choice(torch.device("cuda"))
    first = lines[0]
    assert first.startswith("triton:")
    # Whether Triton is chosen depends on the install; a refusal must say why.
    assert "chosen" in first or "refused: " in first
