"""Backend selection: the right backend per device, overrides, and reasons for refusals."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import native
from kvmesh.kernels.registry import BACKENDS, explain_backend_choice, select_attention_backend
from kvmesh.services.runtime.config.process import NATIVE_KERNELS


def test_cpu_device_gets_the_native_cpu_backend() -> None:
    assert select_attention_backend(torch.device("cpu")).name == "cpu_native"


def test_native_backend_turned_off_falls_back_to_torch_cpu_path_with_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NATIVE_KERNELS.name, "0")
    native._load.cache_clear()
    try:
        lines = explain_backend_choice(torch.device("cpu"))
        reason = f"C++ kernels unavailable: turned off by {NATIVE_KERNELS.name}=0"
        assert lines[0] == f"cpu_native: refused: {reason}"
        assert lines[1] == "cpu: chosen for device cpu (first supported)"
        assert select_attention_backend(torch.device("cpu")).name == "cpu"
    finally:
        native._load.cache_clear()


def test_native_backend_refuses_cuda_devices() -> None:
    lines = explain_backend_choice(torch.device("cuda"), preferred="cpu_native")
    assert lines[0] == "cpu_native: refused: C++ kernels run on CPU tensors only, not cuda"


@pytest.mark.parametrize("name", ["torch_reference", "cpu", "cpu_native"])
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
    assert lines[0] == "cpu_native: chosen for device cpu (first supported)"


def test_cuda_device_prefers_triton_when_available() -> None:
    lines = explain_backend_choice(torch.device("cuda"))
    first = lines[0]
    assert first.startswith("triton:")
    # Whether Triton is chosen depends on the install; a refusal must say why.
    assert "chosen" in first or "refused: " in first
