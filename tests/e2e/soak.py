"""The soak (issue 14): nothing lost while clients walk away and services get SIGKILLed.

Run by ``benchmarks/soak.py`` (``make soak``, the full one) and
``tests/e2e/test_e2e_soak.py`` (a short one in ``make test``); it lives here,
beside its test, and the benchmark imports it.

On one fresh stack (``kvmesh up``):

1. Reference: every distinct (prompt, max_tokens) pair once, greedy, nothing
   disturbed. Prompts vary in length (a topic plus 0..12 filler sentences),
   max_tokens is drawn from a few values.
2. Load: ``--requests`` streamed greedy completions drawn from those pairs,
   ``--concurrency`` at a time. ``--disconnect-fraction`` of them hang up
   after a random number of events (the client aborts). ``--kills`` times,
   spread over the run, a random internal service (worker, scheduler,
   detokenizer) is SIGKILLed; the next kill waits until the stack is ready
   again. A request refused at admission (429/503, e.g. while a stage is down)
   is retried as a client would; the retries are counted.
   With ``solo_reference`` (``benchmarks/soak.py``'s default), every pair is
   first run once more alone (concurrency 1): what the same request gives
   with nothing beside it in any step.
3. Verdict: lost = every request neither completed with exactly the
   reference's text and token count nor disconnected by its own client
   (errors, wrong output, stuck past ``--request-timeout-s``). With the solo
   run, also how many complete texts (of the load and of the reference run)
   differ from it: the requests whose answer depended on the batch they ran
   in (0 with ``--batch-invariant``, kernels/batch_invariant.py). Then, once idle:
   leaked KV blocks (``vllm:kv_cache_usage_perc`` times the pool: must be 0),
   requests still running or waiting in the scheduler (stuck), and each
   service's resident memory (sampled every 2 s: after the reference run, at
   the end, and the most).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import statistics
import time
from dataclasses import dataclass, field

import httpx

from kvmesh.services.cli.local_stack import LocalStack
from tests.e2e.soak_client import StreamResult, rss_mib, stream_completion

SERVICES = ("gateway", "scheduler", "worker", "detokenizer")
VICTIMS = ("worker", "scheduler", "detokenizer")
NUM_KV_BLOCKS = 512
STACK_ARGS = ["--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", "1024"]
TOPICS = (
    "rivers", "bread", "owls", "glass", "salt", "bees", "chess", "stars", "maps", "rain",
    "clocks", "ships", "paper", "music", "trains", "moss",
)  # fmt: skip
FILLER = (
    "Keep the answer short and plain.",
    "Write for a curious reader.",
    "Each fact should be one sentence.",
    "Avoid repeating yourself.",
)
_RETRY_STATUSES = (429, 503)


@dataclass(frozen=True)
class SoakPlan:
    num_requests: int = 2000
    concurrency: int = 32
    disconnect_fraction: float = 0.2
    num_kills: int = 3
    num_prompts: int = 16
    max_tokens_choices: tuple[int, ...] = (8, 24, 48)
    seed: int = 0
    request_timeout_s: float = 600.0
    # Run every pair alone too, and count the texts that differ from it.
    solo_reference: bool = False
    # After the load: how long the scheduler may take to drain to idle.
    idle_timeout_s: float = 60.0


@dataclass(frozen=True)
class SoakRequest:
    prompt: str
    max_tokens: int
    disconnect_after: int | None  # events before the client hangs up; None: reads to the end

    def body(self) -> dict:
        return {
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }


@dataclass
class SoakReport:
    num_requests: int = 0
    completed: int = 0
    disconnected: int = 0
    lost: list[str] = field(default_factory=list)
    admission_retries: int = 0
    kills: list[str] = field(default_factory=list)
    leaked_blocks: int = -1
    stuck_in_scheduler: int = -1
    ttfts: list[float] = field(default_factory=list)
    # service -> (after the reference run, at the end, max) in MiB
    rss: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    wall_s: float = 0.0
    # With a solo run: complete texts that differ from it (-1: no solo run), of
    # the load's requests and of the concurrent reference run's pairs.
    differ_from_solo: int = -1
    completed_texts: int = 0
    reference_differ_from_solo: int = -1
    num_pairs: int = 0

    @property
    def ok(self) -> bool:
        return not self.lost and self.leaked_blocks == 0 and self.stuck_in_scheduler == 0


def make_requests(plan: SoakPlan) -> list[SoakRequest]:
    rng = random.Random(plan.seed)
    prompts = [
        f"Here are three facts about {TOPICS[i % len(TOPICS)]}. "
        + " ".join(rng.choice(FILLER) for _ in range(rng.randint(0, 12)))
        + "\n1."
        for i in range(plan.num_prompts)
    ]
    requests = []
    for _ in range(plan.num_requests):
        max_tokens = rng.choice(plan.max_tokens_choices)
        disconnect = rng.randint(1, max_tokens) if rng.random() < plan.disconnect_fraction else None
        requests.append(SoakRequest(rng.choice(prompts), max_tokens, disconnect))
    return requests


async def _stream_with_retries(
    client: httpx.AsyncClient, request: SoakRequest, report: SoakReport, timeout_s: float
) -> StreamResult:
    """One request as a well-behaved client sends it: refusals at admission are retried."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await stream_completion(client, request.body(), request.disconnect_after)
        if result.status not in _RETRY_STATUSES or time.monotonic() > deadline:
            return result
        report.admission_retries += 1
        await asyncio.sleep(0.5)


async def _reference(
    client: httpx.AsyncClient, requests: list[SoakRequest], concurrency: int
) -> dict[tuple[str, int], StreamResult]:
    pairs = sorted({(r.prompt, r.max_tokens) for r in requests})
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str, max_tokens: int) -> StreamResult:
        async with gate:
            return await stream_completion(client, SoakRequest(prompt, max_tokens, None).body())

    results = await asyncio.gather(*(one(*pair) for pair in pairs))
    for pair, result in zip(pairs, results, strict=True):
        if not result.completed or result.num_tokens != pair[1]:
            raise RuntimeError(f"reference run failed for {pair}: {result}")
    return dict(zip(pairs, results, strict=True))


class RssSampler:
    """Each service's resident memory every ``period_s`` (whichever process serves it now)."""

    def __init__(self, stack: LocalStack, period_s: float = 2.0) -> None:
        self.stack = stack
        self.period_s = period_s
        self.samples: dict[str, list[float]] = {name: [] for name in SERVICES}

    def sample(self) -> None:
        for name in SERVICES:
            for pid in self.stack.service_pids(name):
                mib = rss_mib(pid)
                if mib is not None:
                    self.samples[name].append(mib)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            await asyncio.sleep(self.period_s)


async def _wait_ready(client: httpx.AsyncClient, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (await client.get("/ready", timeout=10)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("the stack did not get ready again")


async def _chaos(
    stack: LocalStack,
    client: httpx.AsyncClient,
    plan: SoakPlan,
    progress: list[int],
    report: SoakReport,
) -> None:
    """SIGKILL a random internal service at evenly spread points of the run."""
    rng = random.Random(plan.seed + 1)
    for k in range(1, plan.num_kills + 1):
        while progress[0] < plan.num_requests * k // (plan.num_kills + 1):
            await asyncio.sleep(0.2)
        await _wait_ready(client)
        victim = rng.choice(VICTIMS)
        old = stack.service_pid(victim)
        os.kill(old, signal.SIGKILL)
        report.kills.append(f"{victim} after {progress[0]} requests")
        print(f"soak: killed {victim} (pid {old}) after {progress[0]} requests", flush=True)
        while old in stack.service_pids(victim) or not stack.service_pids(victim):
            await asyncio.sleep(0.2)


def _scheduler_gauge(stack: LocalStack, name: str) -> float:
    text = httpx.get(stack.metrics_url("scheduler"), timeout=10).text
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return sum(float(v) for v in values)


async def _await_idle(stack: LocalStack, timeout_s: float) -> tuple[int, int]:
    """(leaked KV blocks, requests still in the scheduler) once idle, or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = _scheduler_gauge(stack, "vllm:kv_cache_usage_perc")
        live = _scheduler_gauge(stack, "vllm:num_requests_running") + _scheduler_gauge(
            stack, "vllm:num_requests_waiting"
        )
        if (usage == 0 and live == 0) or time.monotonic() > deadline:
            return round(usage * NUM_KV_BLOCKS), int(live)
        await asyncio.sleep(0.5)


def _judge(request: SoakRequest, result: StreamResult | BaseException, expected: StreamResult):
    """None when the request is accounted for, else why it is lost."""
    if isinstance(result, BaseException):
        return f"{type(result).__name__}: {result}"
    if result.disconnected:
        return None
    if not result.completed:
        return f"status {result.status}, error {result.error!r}"
    if result.num_tokens != request.max_tokens or result.text != expected.text:
        return f"wrong output: {result.text!r} != {expected.text!r}"
    return None


def differ_from_solo(
    requests: list[SoakRequest],
    results: list[StreamResult | BaseException],
    solo: dict[tuple[str, int], StreamResult],
) -> tuple[int, int]:
    """(complete texts that differ from the solo run of their pair, complete
    texts): requests that errored or that their client abandoned have no
    complete text to compare."""
    texts = [
        (request, result)
        for request, result in zip(requests, results, strict=True)
        if isinstance(result, StreamResult) and result.completed and not result.disconnected
    ]
    differ = sum(
        result.text != solo[(request.prompt, request.max_tokens)].text for request, result in texts
    )
    return differ, len(texts)


async def run_soak(stack: LocalStack, plan: SoakPlan) -> SoakReport:
    requests = make_requests(plan)
    report = SoakReport(num_requests=len(requests))
    limits = httpx.Limits(max_connections=plan.concurrency + 8)
    async with httpx.AsyncClient(
        base_url=stack.http_url, timeout=plan.request_timeout_s, limits=limits
    ) as client:
        solo = await _reference(client, requests, 1) if plan.solo_reference else None
        reference = await _reference(client, requests, plan.concurrency)
        report.num_pairs = len(reference)
        if solo is not None:
            report.reference_differ_from_solo = sum(
                reference[pair].text != solo[pair].text for pair in reference
            )
        sampler = RssSampler(stack)
        sampler.sample()
        warm = {name: samples[-1] for name, samples in sampler.samples.items() if samples}
        stop_sampling = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(stop_sampling))
        progress = [0]
        gate = asyncio.Semaphore(plan.concurrency)

        async def one(request: SoakRequest) -> StreamResult:
            async with gate:
                try:
                    return await asyncio.wait_for(
                        _stream_with_retries(client, request, report, plan.request_timeout_s),
                        plan.request_timeout_s,
                    )
                finally:
                    progress[0] += 1

        started = time.monotonic()
        chaos = asyncio.create_task(_chaos(stack, client, plan, progress, report))
        results = await asyncio.gather(*(one(r) for r in requests), return_exceptions=True)
        report.wall_s = time.monotonic() - started
        if not chaos.done():
            chaos.cancel()
        for index, (request, result) in enumerate(zip(requests, results, strict=True)):
            why = _judge(request, result, reference[(request.prompt, request.max_tokens)])
            if why is not None:
                report.lost.append(f"#{index}: {why}")
            elif isinstance(result, StreamResult):
                if result.disconnected:
                    report.disconnected += 1
                else:
                    report.completed += 1
                    if result.ttft_s is not None:
                        report.ttfts.append(result.ttft_s)
        if solo is not None:
            report.differ_from_solo, report.completed_texts = differ_from_solo(
                requests, results, solo
            )
        report.leaked_blocks, report.stuck_in_scheduler = await _await_idle(
            stack, plan.idle_timeout_s
        )
        sampler.sample()
        stop_sampling.set()
        await sampling
    for name, samples in sampler.samples.items():
        if samples:
            report.rss[name] = (warm.get(name, samples[0]), samples[-1], max(samples))
    return report


def _p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100)[98]


def summary_table(report: SoakReport) -> str:
    rows = [
        ("requests", str(report.num_requests)),
        ("completed (output = undisturbed reference)", str(report.completed)),
        ("aborted by their own client", str(report.disconnected)),
        ("lost", str(len(report.lost))),
        ("leaked KV blocks", str(report.leaked_blocks)),
        ("stuck in the scheduler", str(report.stuck_in_scheduler)),
        ("SIGKILLs", "; ".join(report.kills) or "none"),
        ("admissions retried (429/503)", str(report.admission_retries)),
        *(
            [
                (
                    "complete texts that differ from a solo run",
                    f"{report.differ_from_solo} of {report.completed_texts}",
                ),
                (
                    "reference run (concurrent) texts that differ from a solo run",
                    f"{report.reference_differ_from_solo} of {report.num_pairs}",
                ),
            ]
            if report.differ_from_solo >= 0
            else []
        ),
        ("p99 TTFT (completed)", f"{_p99(report.ttfts):.2f} s"),
        ("wall time", f"{report.wall_s:.0f} s"),
    ]
    rows += [
        (f"RSS {name} (warm / end / max)", f"{warm:.0f} / {end:.0f} / {peak:.0f} MiB")
        for name, (warm, end, peak) in report.rss.items()
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'':{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name:{width}} | {value} |" for name, value in rows]
    return "\n".join(lines)
