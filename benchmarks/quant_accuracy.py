"""What quantized weights cost in accuracy: greedy agreement and perplexity.

For one model, five ways to hold its weights — the float32 checkpoint, its
GGUF file loaded directly (codes kept), ``--quantization int8`` of the float32
checkpoint, ``--quantization w8a8`` of it and of the GGUF file (the same
codes, times per-token int8 activations) — this prints, against
transformers' float32 greedy tokens on the e2e prompts
(tests/e2e/test_e2e_greedy_matches_hf.py, 40 tokens each, EOS ignored), the
greedy agreement and the perplexity of ``FIXED_TEXT``, measured as
``tests/worker/quant_accuracy.py`` defines them (shared with the tests).

    python -m benchmarks.quant_accuracy [--gguf FILE] [--model FOLDER]

Defaults: the default model's folder (converted from the GGUF) and that GGUF.
"""

from __future__ import annotations

import argparse
import os

from kvmesh.worker.dtype_choice import CpuFeatures
from tests.worker.quant_accuracy import (
    FIXED_TEXT,
    agreement,
    greedy_tokens,
    make_runner,
    perplexity,
)


def main(argv: list[str] | None = None) -> int:
    from kvmesh.services.runtime.model_prep import _find_gguf, default_model_path
    from tests.e2e import hf_oracle
    from tests.e2e.test_e2e_greedy_matches_hf import MAX_TOKENS, PROMPTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--gguf", default="")
    args = parser.parse_args(argv)
    tokenizer = hf_oracle.tokenizer()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    reference = [hf_oracle.greedy(prompt, MAX_TOKENS) for prompt in prompts]
    text_ids = tokenizer(FIXED_TEXT)["input_ids"]
    cpu = CpuFeatures.detect()
    print(
        f"CPU: {cpu.model_name} ({cpu.isa_summary()}), {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(f"{len(prompts)} prompts x {MAX_TOKENS} tokens; perplexity over {len(text_ids)} tokens")
    print("| weights | greedy agreement | perplexity | weights resident (MB) |")
    print("|---|---|---|---|")
    cases = [
        ("float32 checkpoint", args.model, None),
        ("GGUF file, direct", args.gguf or str(_find_gguf()), None),
        ("--quantization int8", args.model, "int8"),
        ("--quantization w8a8", args.model, "w8a8"),
        ("GGUF file, --quantization w8a8", args.gguf or str(_find_gguf()), "w8a8"),
    ]
    for label, path, quantization in cases:
        runner = make_runner(path, quantization)
        sizes = runner.model.weight_bytes()
        resident = sizes["projections"] + sizes["embedding_codes"] + sizes["parameters"]
        tokens = greedy_tokens(runner, prompts, MAX_TOKENS)
        print(
            f"| {label} | {100 * agreement(reference, tokens):.1f}% | "
            f"{perplexity(runner, text_ids):.4f} | {resident / 1e6:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
