"""kvmesh's perplexity against llama.cpp's ``llama-perplexity``: same file, text, positions.

Usage: .venv/bin/python -m benchmarks.llamacpp_perplexity [--mix Q4_K_M Q8_0 F16] [--ctx 43]
           [--threads N] [--build]

The text is ``FIXED_TEXT`` (tests/worker/quant_accuracy.py), the one
benchmarks/kquant_accuracy.py scores. The files are the default model's GGUF
files made by llama.cpp's own tools (``llamacpp_compare.llamacpp_gguf``: F16
from ``convert_hf_to_gguf.py``, the mixes from ``llama-quantize``), read by
both sides.

What each side scores. ``llama-perplexity`` cuts the text's tokens into
``len // ctx`` chunks of ``ctx`` tokens, runs each chunk as a fresh context,
and scores only the second half of each: the tokens at chunk positions
``ctx // 2 + 1 .. ctx - 1``, each given the chunk's tokens before it. It
needs at least ``2 * ctx`` tokens, so FIXED_TEXT's 87 allow ``ctx`` 43 at
most: 2 chunks, 21 scored tokens each. kvmesh's figure here is computed the
same way: each chunk a fresh prompt (``prompt_logprobs``), the same
positions, exp of their mean negative log-likelihood. (kquant_accuracy's
figure, every position 1..86 of the whole text in one context, is printed
beside it; it is not comparable to llama.cpp's.) The SmolLM2 files set no
``add_bos_token``, so neither side puts a BOS in front of a chunk.

``llama-perplexity`` is built from the same llama.cpp tree that
llamacpp_compare.py builds ``llama-server`` from (its cache); ``--build``
builds it there when it is missing (one target, ``-j1``: a few minutes),
otherwise the script says how. The token count llama.cpp sees is checked
against kvmesh's tokenizer's (the same ids are assumed, not compared).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.llamacpp_compare import cache_dir, llamacpp_gguf  # noqa: E402
from kvmesh.services.contracts.sampling_params import SamplingParams  # noqa: E402
from kvmesh.services.runtime.cpu_features import CpuFeatures  # noqa: E402
from kvmesh.services.runtime.model_prep import default_model_path  # noqa: E402
from kvmesh.worker.local_driver import LocalDriver  # noqa: E402
from kvmesh.worker.model_runner import ModelRunner  # noqa: E402
from tests.worker.quant_accuracy import FIXED_TEXT, make_runner, perplexity  # noqa: E402

FILES = ("Q4_K_M", "Q8_0", "F16")
# The largest context llama-perplexity accepts on FIXED_TEXT (87 tokens: 2 x 43).
DEFAULT_CTX = 43


def perplexity_binary() -> Path:
    return cache_dir() / "build" / "bin" / "llama-perplexity"


def build_perplexity() -> Path:
    """``llama-perplexity`` in the build folder of llamacpp_compare's tree (once)."""
    binary = perplexity_binary()
    if not binary.is_file():
        build = cache_dir() / "build"
        if not (build / "CMakeCache.txt").is_file():
            raise SystemExit(
                "no llama.cpp build: run `python benchmarks/llamacpp_compare.py --build-only` first"
            )
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-perplexity", "-j1"], check=True
        )
    return binary


def scored_positions(num_tokens: int, ctx: int) -> list[tuple[int, list[int]]]:
    """llama-perplexity's scoring: (chunk start, the chunk positions it scores) per chunk."""
    scored = list(range(ctx // 2 + 1, ctx))
    return [(chunk * ctx, scored) for chunk in range(num_tokens // ctx)]


def chunked_perplexity(runner: ModelRunner, token_ids: list[int], ctx: int) -> float:
    """kvmesh's perplexity over llama-perplexity's positions (``scored_positions``)."""
    nll, count = 0.0, 0
    for start, positions in scored_positions(len(token_ids), ctx):
        driver = LocalDriver(runner)
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        driver.add_request("chunk", token_ids[start : start + ctx], params, 1)
        scored = driver.run()["chunk"].prompt_logprobs
        nll -= sum(scored[p].logprob for p in positions)
        count += len(positions)
    return math.exp(nll / count)


def llamacpp_perplexity(binary: Path, gguf: Path, ctx: int, threads: int) -> tuple[float, int]:
    """(llama-perplexity's final estimate on FIXED_TEXT, the number of tokens it saw)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as text:
        text.write(FIXED_TEXT)
    try:
        base = [str(binary), "-m", str(gguf), "-f", text.name, "-t", str(threads)]
        run = subprocess.run([*base, "-c", str(ctx)], capture_output=True, text=True)
        found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
        if found is None:
            raise RuntimeError(f"llama-perplexity printed no estimate:\n{run.stderr[-2000:]}")
        # Asked for more context than the text has, it says how many tokens it has.
        probe = subprocess.run([*base, "-c", "4096"], capture_output=True, text=True)
        count = re.search(r"tokenizes to only (\d+) tokens", probe.stdout + probe.stderr)
        return float(found.group(1)), int(count.group(1)) if count else -1
    finally:
        os.unlink(text.name)


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", nargs="+", choices=FILES, default=list(FILES))
    parser.add_argument("--ctx", type=int, default=DEFAULT_CTX)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--build", action="store_true", help="build llama-perplexity if missing")
    args = parser.parse_args(argv)
    binary = build_perplexity() if args.build else perplexity_binary()
    if not binary.is_file():
        print(f"{binary} is missing: rerun with --build", file=sys.stderr)
        return 1
    checkpoint = default_model_path()
    token_ids = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(FIXED_TEXT).ids
    chunks = scored_positions(len(token_ids), args.ctx)
    cpu = CpuFeatures.detect()
    print(f"CPU: {cpu.model_name} ({cpu.isa_summary()}); load {os.getloadavg()[0]:.2f}")
    print(
        f"FIXED_TEXT: {len(token_ids)} tokens; ctx {args.ctx}: {len(chunks)} chunks, "
        f"{sum(len(p) for _, p in chunks)} scored tokens (each chunk's second half)"
    )
    print(
        "| file | llama.cpp PPL | kvmesh PPL, same positions | kvmesh w8a8, same positions "
        "| kvmesh PPL, all 86 positions |"
    )
    print("|---|---|---|---|---|")
    reference = make_runner(checkpoint)
    same = chunked_perplexity(reference, token_ids, args.ctx)
    print(
        f"| float32 checkpoint (kvmesh only) | — | {same:.4f} | — "
        f"| {perplexity(reference, token_ids):.4f} |",
        flush=True,
    )
    for mix in args.mix:
        gguf, folder = llamacpp_gguf(checkpoint, mix)
        theirs, seen = llamacpp_perplexity(binary, gguf, args.ctx, args.threads)
        if seen not in (-1, len(token_ids)):
            print(f"  warning: llama.cpp saw {seen} tokens, kvmesh's tokenizer {len(token_ids)}")
        exact = make_runner(folder)
        w8a8 = make_runner(folder, "w8a8") if mix != "F16" else None
        ours_w8a8 = f"{chunked_perplexity(w8a8, token_ids, args.ctx):.4f}" if w8a8 else "—"
        print(
            f"| {gguf.name} | {theirs:.4f} | {chunked_perplexity(exact, token_ids, args.ctx):.4f} "
            f"| {ours_w8a8} | {perplexity(exact, token_ids):.4f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
