"""What quantized weights cost in accuracy: greedy agreement and perplexity.

For one model, five ways to hold its weights — the float32 checkpoint, its
GGUF file loaded directly (codes kept), ``--quantization int8`` of the float32
checkpoint, ``--quantization w8a8`` of it and of the GGUF file (the same
codes, times per-token int8 activations) — this prints, against
transformers' float32 greedy tokens on the e2e prompts
(tests/e2e/test_e2e_greedy_matches_hf.py, 40 tokens each, EOS ignored):

* agreement: tokens before each prompt's first divergence, over all tokens
  (after a divergence the continuations are different texts; comparing them
  position by position would mean nothing);
* perplexity of ``FIXED_TEXT`` (every token's log-probability as a prompt).

    python -m benchmarks.quant_accuracy [--gguf FILE] [--model FOLDER]

Defaults: the default model's folder (converted from the GGUF) and that GGUF.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from services.sampling_params import SamplingParams
from worker.config import CacheConfig, ModelConfig
from worker.dtype_choice import CpuFeatures
from worker.local_driver import LocalDriver
from worker.model_runner import ModelRunner

FIXED_TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century and "
    "spread to continental Europe and North America during the nineteenth. Mechanized "
    "spinning and weaving transformed the textile industry, while improvements to the steam "
    "engine by James Watt made it practical to power factories, mines and, later, railways. "
    "Cities grew quickly as workers moved from the countryside in search of wages, and the "
    "new factory system changed how people lived, worked and thought about time."
)


def make_runner(path: str | Path, quantization: str | None = None) -> ModelRunner:
    """A float32 runner with a small cache, one thread (a shared 2-core box)."""
    return ModelRunner(
        ModelConfig.from_pretrained(path, max_model_len=512, quantization=quantization),
        CacheConfig(block_size=16, num_kv_blocks=96),
        num_threads=1,
    )


def greedy_tokens(
    runner: ModelRunner, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Each prompt's ``max_tokens`` greedy tokens (EOS ignored), all in one batch."""
    driver = LocalDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        driver.add_request(str(index), prompt, params, max_tokens)
    finished = driver.run()
    return [finished[str(index)].output_token_ids for index in range(len(prompts))]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> float:
    """Tokens before each sequence's first divergence from ``reference``, over all tokens."""
    agreed = total = 0
    for want, got in zip(reference, tokens, strict=True):
        total += len(want)
        for a, b in zip(want, got, strict=False):
            if a != b:
                break
            agreed += 1
    return agreed / total


def perplexity(runner: ModelRunner, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of tokens 1..n given their prefixes."""
    driver = LocalDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    driver.add_request("ppl", token_ids, params, 1)
    scored = driver.run()["ppl"].prompt_logprobs
    logprobs = [scored[position].logprob for position in range(1, len(token_ids))]
    return math.exp(-sum(logprobs) / len(logprobs))


def main(argv: list[str] | None = None) -> int:
    from services.model_prep import _find_gguf, default_model_path
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
