"""What llama.cpp's K-quant mixes cost the default model in accuracy.

For the float32 checkpoint and each GGUF file of tests/worker/kquant_files.py
(Q4_K_M, Q5_K_M, Q6_K, Q8_0), loaded by kvmesh from its blocks, this prints on
``FIXED_TEXT`` (benchmarks/quant_accuracy.py):

* teacher-forced top-1 agreement: at every position of the text, whether the
  file's most likely next token is the float32 checkpoint's (the text itself is
  the prefix for both, so one miss does not derail the rest);
* perplexity of the text;
* file size and resident weight bytes (the worker's report).

    python -m benchmarks.kquant_accuracy [--mix Q4_K_M ...]

Its perplexity scores every position of the whole text in one context; against
llama.cpp's own ``llama-perplexity`` (which scores each chunk's second half),
benchmarks/llamacpp_perplexity.py scores the same positions on both sides.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from benchmarks.quant_accuracy import FIXED_TEXT, make_runner
from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.services.runtime.cpu_features import CpuFeatures
from kvmesh.services.runtime.model_prep import default_model_path
from kvmesh.worker.local_driver import LocalDriver
from kvmesh.worker.model_runner import ModelRunner
from tests.worker.kquant_files import MIXES, write_mix


def scored_text(runner: ModelRunner, token_ids: list[int]) -> tuple[list[int], float]:
    """(the top-1 next token at every position, perplexity of the text)."""
    driver = LocalDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    driver.add_request("text", token_ids, params, 1)
    scored = driver.run()["text"].prompt_logprobs
    positions = range(1, len(token_ids))
    top1 = [scored[p].top_token_ids[0] for p in positions]
    nll = -sum(scored[p].logprob for p in positions) / len(positions)
    return top1, math.exp(nll)


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--mix", action="append", choices=MIXES)
    args = parser.parse_args(argv)
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    text_ids = tokenizer.encode(FIXED_TEXT).ids
    cpu = CpuFeatures.detect()
    print(f"CPU: {cpu.model_name} ({cpu.isa_summary()}), {os.cpu_count()} cores")
    print(f"FIXED_TEXT: {len(text_ids)} tokens, {len(text_ids) - 1} scored positions")
    print("| weights | top-1 agreement vs float32 | perplexity | file MiB | resident MB |")
    print("|---|---|---|---|---|")
    reference, ppl = scored_text(make_runner(args.model), text_ids)
    print(f"| float32 checkpoint | 100% | {ppl:.4f} | — | — |")
    for mix in args.mix or MIXES:
        files = write_mix(args.model, mix)
        runner = make_runner(files.folder)
        top1, ppl = scored_text(runner, text_ids)
        agree = sum(a == b for a, b in zip(reference, top1, strict=True)) / len(top1)
        print(
            f"| {mix} | {100 * agree:.1f}% | {ppl:.4f} | "
            f"{files.gguf.stat().st_size / 2**20:.1f} | "
            f"{runner.model.resident_weight_bytes() / 1e6:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
