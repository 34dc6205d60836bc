"""``kvmesh bench``: load-test an OpenAI-compatible completions or embeddings endpoint, as vLLM."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from kvmesh.services.cli.bench.client import ClientConfig, CompletionsClient
from kvmesh.services.cli.bench.dataset import (
    BenchTokenizer,
    PromptKind,
    RandomDatasetConfig,
    sample_random_requests,
    sample_warmup_request,
)
from kvmesh.services.cli.bench.embeddings_client import (
    EmbeddingsClient,
    group_requests,
    is_embeddings_endpoint,
)
from kvmesh.services.cli.bench.metrics import compute_metrics
from kvmesh.services.cli.bench.plot import require_matplotlib, write_latency_histograms
from kvmesh.services.cli.bench.report import build_result, format_report, write_result
from kvmesh.services.cli.bench.runner import LoadConfig, run_load, warm_up
from kvmesh.services.cli.bench.sampling import GREEDY, SAMPLING_SETTINGS, SamplingSetting
from kvmesh.services.runtime.config.process import OPENAI_API_KEY

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh bench",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument("--endpoint", default="/v1/completions")
    target.add_argument(
        "--model", default=None, help="model name to send (default: first id of /v1/models)"
    )
    target.add_argument(
        "--api-key",
        default=None,  # resolved at use, so that --help never prints the key
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)",
    )
    target.add_argument("--request-timeout", type=float, default=6 * 60 * 60, help="seconds")

    workload = parser.add_argument_group("workload (vLLM's random dataset)")
    workload.add_argument("--num-prompts", type=int, default=100)
    workload.add_argument("--input-len", type=int, default=1024, help="random prompt tokens")
    workload.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    workload.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="draw lengths uniformly from [len*(1-r), len*(1+r)] (vLLM --random-range-ratio)",
    )
    workload.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="random tokens every prompt starts with, before its --input-len own tokens "
        "(vLLM --random-prefix-len)",
    )
    workload.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="model folder or tokenizer.json the prompts are drawn from "
        "(default: the kvmesh default model folder)",
    )
    workload.add_argument(
        "--prompt-kind",
        choices=[kind.value for kind in PromptKind],
        default=PromptKind.TOKEN_IDS.value,
        help="send prompts as token id lists (exact lengths) or as decoded text",
    )
    workload.add_argument(
        "--min-input-len",
        type=int,
        default=0,
        help="draw input lengths log-uniformly from [min, --input-len] instead (0: off)",
    )
    workload.add_argument(
        "--inputs-per-request",
        type=int,
        default=1,
        help="embedding workload (--endpoint /v1/embeddings): prompts sent in one request's "
        "input list",
    )
    workload.add_argument("--seed", type=int, default=0, help="prompts and arrival times")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s, Poisson (inf: all at once)",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    load.add_argument(
        "--num-warmups", type=int, default=1, help="untimed requests sent first, one at a time"
    )
    load.add_argument(
        "--sampling",
        choices=list(SAMPLING_SETTINGS),
        default=GREEDY.name,
        help="sampling fields sent: greedy (temperature 0), none-given (no field: the "
        "server's defaults, as vllm bench serve), t0.7-p0.9 (temperature 0.7, top_p 0.9)",
    )
    load.add_argument(
        "--temperature", type=float, default=None, help="sent instead of --sampling's"
    )
    load.add_argument("--top-p", type=float, default=None, help="sent instead of --sampling's")
    load.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly --output-len tokens per request",
    )

    output = parser.add_argument_group("output")
    output.add_argument("--label", default="kvmesh", help="a name for this run in the result")
    output.add_argument("--result-file", type=Path, default=None, help="write the JSON result")
    output.add_argument("--plot", type=Path, default=None, help="write TTFT/ITL histograms (PNG)")
    output.add_argument(
        "--percentiles", default="90,99", help="comma-separated percentiles to report"
    )
    output.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return parser


def _percentiles(text: str) -> tuple[float, ...]:
    values = tuple(float(part) for part in text.split(",") if part.strip())
    if not values or not all(0 <= value <= 100 for value in values):
        raise ValueError(f"--percentiles must be numbers in [0, 100], got {text!r}")
    return values


def sampling_setting(args: argparse.Namespace) -> SamplingSetting:
    """--sampling's setting, with --temperature / --top-p in place of its fields."""
    setting = SAMPLING_SETTINGS[args.sampling]
    if args.temperature is None and args.top_p is None:
        return setting
    return SamplingSetting(
        name=f"{setting.name}+custom",
        temperature=args.temperature if args.temperature is not None else setting.temperature,
        top_p=args.top_p if args.top_p is not None else setting.top_p,
    )


async def _run(args: argparse.Namespace) -> int:
    tokenizer_path = args.tokenizer
    if tokenizer_path is None:
        from kvmesh.services.runtime.model_prep import default_model_path

        tokenizer_path = default_model_path()
    dataset = RandomDatasetConfig(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        shared_prefix_len=args.shared_prefix_len,
        seed=args.seed,
        prompt_kind=PromptKind(args.prompt_kind),
        min_input_len=args.min_input_len,
    )
    load = LoadConfig(
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        show_progress=not args.disable_tqdm,
    )
    percentiles = _percentiles(args.percentiles)
    if args.plot is not None:
        require_matplotlib()
    tokenizer = BenchTokenizer.from_path(tokenizer_path)
    requests = sample_random_requests(dataset, tokenizer)
    embeddings = is_embeddings_endpoint(args.endpoint)
    warmup = sample_warmup_request(dataset, tokenizer)
    if embeddings:
        requests = group_requests(requests, args.inputs_per_request)
        warmup = group_requests([warmup], 1)[0]

    sampling = sampling_setting(args)
    client_config = ClientConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        api_key=args.api_key or OPENAI_API_KEY.get() or None,
        ignore_eos=args.ignore_eos,
        sampling=sampling,
        max_connections=args.max_concurrency or args.num_prompts,
        timeout_s=args.request_timeout,
    )
    client_class = EmbeddingsClient if embeddings else CompletionsClient
    async with client_class(client_config) as client:
        model = args.model or await client.first_model_id()
        client.config = dataclasses.replace(client.config, model=model)
        print(f"Benchmarking {model} at {client.config.url}")
        if args.num_warmups > 0:
            print(f"Warming up with {args.num_warmups} request(s)...")
            await warm_up(client.send, warmup, args.num_warmups)
        print(
            f"Traffic request rate: {args.request_rate}\n"
            f"Maximum request concurrency: {args.max_concurrency}"
        )
        result = await run_load(client.send, requests, load)

    failures = [output for output in result.outputs if not output.success]
    for output in failures[:10]:
        print(f"Failed request {output.request_id}: {output.error}")
    metrics = compute_metrics(result.outputs, result.duration_s, percentiles)
    print(format_report(metrics, args.request_rate, args.max_concurrency))
    if embeddings:
        inputs = sum(
            r.output_len for r, o in zip(requests, result.outputs, strict=True) if o.success
        )
        print(
            f"Embedded inputs: {inputs} ({inputs / result.duration_s:.2f} inputs/s, "
            f"{args.inputs_per_request} per request)"
        )

    config: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": args.label,
        "backend": "openai",
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer": str(tokenizer_path),
        "prompt_kind": dataset.prompt_kind.value,
        "num_prompts": dataset.num_prompts,
        "input_len": dataset.input_len,
        "output_len": dataset.output_len,
        "range_ratio": dataset.range_ratio,
        "shared_prefix_len": dataset.shared_prefix_len,
        "request_rate": load.request_rate,
        "burstiness": 1.0,
        "max_concurrency": load.max_concurrency,
        "seed": args.seed,
        "num_warmups": args.num_warmups,
        "sampling": sampling.name,
        **sampling.fields(),
        "ignore_eos": args.ignore_eos,
        "min_input_len": dataset.min_input_len,
        "inputs_per_request": args.inputs_per_request if embeddings else 1,
    }
    if args.result_file is not None:
        write_result(
            args.result_file,
            build_result(config, metrics, result.outputs, result.arrival_offsets_s),
        )
        print(f"Wrote {args.result_file}")
    if args.plot is not None:
        write_latency_histograms(result.outputs, args.plot, f"{args.label}: {model}")
        print(f"Wrote {args.plot}")
    return 0 if metrics.completed > 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        return uvloop.run(_run(args))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"kvmesh bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
