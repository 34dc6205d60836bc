"""The command line: help through ``kvmesh``, and a whole run against the fake server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.services.cli.bench.cli import build_parser, main, sampling_setting
from kvmesh.services.cli.bench.dataset import BenchTokenizer
from kvmesh.services.runtime.model_prep import default_model_path
from tests.bench.fake_openai_server import MODEL_ID, PROMPT_TOKENS, FakeOpenAIServer

REPO_ROOT = Path(__file__).resolve().parents[2]


def kvmesh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.services.cli.main", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_after_separator_lists_bench_options() -> None:
    done = kvmesh("bench", "--", "--help")
    assert done.returncode == 0, done.stderr
    for option in ("--max-concurrency", "--request-rate", "--shared-prefix-len", "--result-file"):
        assert option in done.stdout


def test_help_lists_bench_options() -> None:
    done = kvmesh("bench", "--help")
    assert done.returncode == 0, done.stderr
    assert "--max-concurrency" in done.stdout


def test_full_run_writes_result_and_plot(
    fake_server: FakeOpenAIServer,
    bench_tokenizer: BenchTokenizer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake_server.reset(chunk_delay_s=0.002)
    result_file = tmp_path / "result.json"
    plot_file = tmp_path / "latency.png"
    code = main(
        [
            f"--base-url={fake_server.base_url}",
            f"--tokenizer={default_model_path()}",
            "--num-prompts=8",
            "--input-len=16",
            "--output-len=5",
            "--max-concurrency=2",
            "--disable-tqdm",
            f"--result-file={result_file}",
            f"--plot={plot_file}",
            "--label=fake",
        ]
    )
    assert code == 0
    report = capsys.readouterr().out
    assert f"{'Successful requests:':<40} {8:<10}" in report
    assert f"{'Total generated tokens:':<40} {40:<10}" in report
    # 8 timed requests plus the warm-up.
    assert fake_server.observed.num_requests == 9
    assert fake_server.observed.max_in_flight <= 2
    timed = fake_server.observed.payloads[1:]
    assert all(len(payload["prompt"]) == 16 for payload in timed)
    result = json.loads(result_file.read_text())
    assert result["model_id"] == MODEL_ID  # asked /v1/models since --model was not given
    assert result["label"] == "fake"
    assert result["completed"] == 8
    assert result["total_output_tokens"] == 40
    assert result["input_lens"] == [PROMPT_TOKENS] * 8
    assert result["max_concurrency"] == 2 and result["request_rate"] == "inf"
    assert len(result["itls"]) == 8 and all(len(gaps) == 4 for gaps in result["itls"])
    assert plot_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failed_warm_up_exits_with_a_message(
    fake_server: FakeOpenAIServer,
    bench_tokenizer: BenchTokenizer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake_server.reset(http_status=404)
    code = main(
        [
            f"--base-url={fake_server.base_url}",
            f"--tokenizer={default_model_path()}",
            "--model=m",
            "--num-prompts=2",
            "--input-len=4",
            "--output-len=2",
            "--disable-tqdm",
        ]
    )
    assert code == 2
    assert "warm-up request failed: HTTP 404" in capsys.readouterr().err
    assert fake_server.observed.num_requests == 1  # nothing timed was sent


@pytest.mark.parametrize(
    ("flags", "fields"),
    [
        ([], {"temperature": 0.0}),
        (["--sampling=none-given"], {}),
        (["--sampling=t0.7-p0.9"], {"temperature": 0.7, "top_p": 0.9}),
        (["--sampling=none-given", "--top-p=0.5"], {"top_p": 0.5}),
        (["--temperature=1.2"], {"temperature": 1.2}),
    ],
)
def test_sampling_flags_choose_the_fields_sent(flags: list[str], fields: dict) -> None:
    assert sampling_setting(build_parser().parse_args(flags)).fields() == fields


def test_embedding_workload_batches_log_uniform_inputs(
    fake_server: FakeOpenAIServer,
    bench_tokenizer: BenchTokenizer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--endpoint /v1/embeddings: --inputs-per-request prompts per POST, lengths
    log-uniform in [--min-input-len, --input-len], inputs/s reported."""
    fake_server.reset(first_delay_s=0.01)
    result_file = tmp_path / "result.json"
    code = main(
        [
            f"--base-url={fake_server.base_url}",
            f"--tokenizer={default_model_path()}",
            "--endpoint=/v1/embeddings",
            "--num-prompts=40",
            "--min-input-len=16",
            "--input-len=512",
            "--inputs-per-request=16",
            "--max-concurrency=2",
            "--num-warmups=0",
            "--disable-tqdm",
            f"--result-file={result_file}",
        ]
    )
    assert code == 0
    payloads = fake_server.observed.payloads
    assert [len(p["input"]) for p in payloads] == [16, 16, 8]
    lengths = [len(ids) for p in payloads for ids in p["input"]]
    assert min(lengths) >= 16 and max(lengths) <= 512
    assert min(lengths) < 64 and max(lengths) > 128  # spread over the log range
    assert fake_server.observed.max_in_flight <= 2
    out = capsys.readouterr().out
    assert "Embedded inputs: 40 (" in out
    result = json.loads(result_file.read_text())
    assert result["inputs_per_request"] == 16
    assert result["total_input_tokens"] == sum(lengths)
