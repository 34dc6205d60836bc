"""PEFT LoRA adapters made in tests, with random nonzero A and B so they change the output."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kvmesh.services.contracts.lora_files import adapter_id
from kvmesh.services.contracts.lora_request import LoRARequest


def make_lora_adapter(
    base_folder: Path,
    folder: Path,
    *,
    rank: int,
    alpha: float,
    target_modules: Sequence[str] | str,
    seed: int,
    scale: float,
    use_rslora: bool = False,
) -> torch.nn.Module:
    """Save a PEFT adapter of the checkpoint at ``base_folder`` into ``folder``.

    Returns the float32 PeftModel (transformers + PEFT): the oracle to compare with.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(folder)
    return model.eval()


def lora_request(name: str, folder: Path) -> LoRARequest:
    return LoRARequest(lora_name=name, lora_id=adapter_id(folder), lora_path=str(folder))
