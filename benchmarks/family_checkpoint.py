"""Random-weight checkpoints of model-zoo families at a realistic size (issue 38's speed rows).

Tests use tiny checkpoints (tests/worker/model_families.py); a speed comparison needs the
shapes a user serves. Each family here is a released model's layer shape scaled to
~150-400M parameters, with the default model's tokenizer (49,152 tokens) so both servers
read the same folder and ``vllm bench serve``-style random prompts tokenize alike:

- ``qwen3``: Qwen3-0.6B's layer (hidden 1,024, 16 query / 8 KV heads of 128, q/k norms,
  MLP 3,072, tied embeddings), 12 layers: ~240M.
- ``gemma3``: Gemma 3 270M's layer (hidden 640, 4 query / 1 KV head of 256, a 512-token
  window on five layers of six, (1 + w) norms, pre/post norms), MLP 3,072, 18 layers: ~170M.
- ``qwen3-moe``: Qwen3-30B-A3B's layer scaled down (hidden 768, 12 query / 4 KV heads of
  64, 32 experts of width 384, top-4, renormalized), 12 layers: ~400M, ~100M active.

Weights follow transformers' own initialisation (normal, std 0.02), saved in bfloat16 as
released checkpoints are; the servers convert to their dtype.

    .venv/bin/python benchmarks/family_checkpoint.py --family qwen3 --out /tmp/bench-qwen3
    .venv/bin/python benchmarks/vllm_compare.py --model /tmp/bench-qwen3
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.services.runtime.model_prep import default_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 49_152  # the default model's tokenizer


def family_config(family: str) -> Any:
    """The transformers config of ``family``'s benchmark checkpoint."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    if family == "qwen3":
        return transformers.Qwen3Config(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            **common,
        )
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            hidden_size=640,
            intermediate_size=3072,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)
            ],
            tie_word_embeddings=True,
            **common,
        )
    if family == "qwen3-moe":
        return transformers.Qwen3MoeConfig(
            hidden_size=768,
            intermediate_size=1536,
            moe_intermediate_size=384,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=64,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            **common,
        )
    raise ValueError(f"unknown family {family!r}: qwen3, gemma3 or qwen3-moe")


ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3-moe": "Qwen3MoeForCausalLM",
}


def write_checkpoint(family: str, out: Path, seed: int = 0) -> int:
    """Save ``family``'s random checkpoint and the default model's tokenizer in ``out``;
    return its parameter count."""
    import transformers

    config = family_config(family)
    config.torch_dtype = torch.bfloat16
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[family])(config)
    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    source = default_model_path()
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(ARCHITECTURES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    params = write_checkpoint(args.family, args.out, args.seed)
    print(f"{args.out}: {ARCHITECTURES[args.family]}, {params / 1e6:.0f}M parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
