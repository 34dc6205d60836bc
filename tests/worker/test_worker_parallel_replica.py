"""A TP / PP / TP x PP replica of spawned gloo ranks equals one process on a tiny model.

Greedy tokens must be identical and every logprob (sampled and top 5) within
1e-4: only the order of float32 sums differs (o_proj's and down's partial sums
are added across ranks, LoRA deltas of o_proj and down with them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.worker.parallel.collectives import STEP_CHUNK_BYTES, Collectives
from kvmesh.worker.parallel.layout import RankLayout
from kvmesh.worker.parallel.local_replica import run_local_replica
from tests.lora_adapters import make_lora_adapter

from .conftest import make_tiny_checkpoint
from .gguf_files import write_tiny_gguf
from .parallel_ranks import Result, RunSpec, run_replica, run_single

LOGPROB_TOLERANCE = 1e-4
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [7] * 20 + [1, 2, 3], [100, 30]]


def assert_same_outputs(expected: Result, actual: Result) -> None:
    assert expected.keys() == actual.keys()
    for req_id, (tokens, logprobs, error) in expected.items():
        actual_tokens, actual_logprobs, actual_error = actual[req_id]
        assert actual_error == error, req_id
        assert actual_tokens == tokens, req_id
        for step, (want, got) in enumerate(zip(logprobs, actual_logprobs, strict=True)):
            assert [t for t, _ in got] == [t for t, _ in want], (req_id, step)
            gaps = [abs(a - b) for (_, a), (_, b) in zip(want, got, strict=True)]
            assert max(gaps) < LOGPROB_TOLERANCE, (req_id, step, gaps)


@pytest.fixture(scope="module")
def uneven_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 query heads in 3 KV groups: TP=2 splits them 2 + 1 groups."""
    folder = tmp_path_factory.mktemp("uneven")
    make_tiny_checkpoint(
        folder,
        "LlamaForCausalLM",
        torch.float32,
        tie_word_embeddings=True,
        num_attention_heads=6,
        num_key_value_heads=3,
        hidden_size=96,
        head_dim=16,
        num_hidden_layers=3,
        vocab_size=131,  # odd: the last vocab shard is short
    )
    return folder


@pytest.fixture(scope="module")
def uneven_adapters(uneven_heads: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two PEFT adapters of ``uneven_heads``: every projection (rank 8), and q, v
    and down only (rank 4: o_proj's rows stay the base model's)."""
    root = tmp_path_factory.mktemp("uneven-lora")
    targets = {
        "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "qv-down": ("q_proj", "v_proj", "down_proj"),
    }
    for seed, (name, modules) in enumerate(targets.items()):
        make_lora_adapter(
            uneven_heads,
            root / name,
            rank=8 if name == "all" else 4,
            alpha=16.0,
            target_modules=modules,
            seed=seed,
            scale=0.3,
        )
    return [str(root / name) for name in targets]


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A single KV head: TP=2 replicates it, each rank computing 2 of the 4 query heads."""
    folder = tmp_path_factory.mktemp("mqa")
    make_tiny_checkpoint(folder, "Qwen2ForCausalLM", torch.float32, num_key_value_heads=1)
    return folder


@pytest.mark.parametrize(("tp_size", "pp_size"), [(2, 1), (1, 2), (2, 2)])
def test_replica_matches_one_process(uneven_heads: Path, tp_size: int, pp_size: int) -> None:
    # Chunked prefill: prompts span several steps, so the KV cache written by
    # each rank's shard is read back by later steps.
    spec = RunSpec(str(uneven_heads), PROMPTS, chunk_size=8)
    assert_same_outputs(run_single(spec), run_replica(tp_size, pp_size, spec))


def test_replicated_kv_head_matches_one_process(one_kv_head: Path) -> None:
    spec = RunSpec(str(one_kv_head), PROMPTS)
    assert_same_outputs(run_single(spec), run_replica(2, 1, spec))


def test_dense_path_matches_one_process(uneven_heads: Path) -> None:
    # Plain F.linear on both sides (no oneDNN packing, no C++ ops).
    spec = RunSpec(str(uneven_heads), PROMPTS, dense=True)
    assert_same_outputs(run_single(spec), run_replica(2, 1, spec))


@pytest.mark.parametrize(("tp_size", "pp_size"), [(1, 2), (2, 2), (1, 3)])
def test_pipeline_overlap_keeps_two_steps_begun_and_matches_one_process(
    uneven_heads: Path, tp_size: int, pp_size: int
) -> None:
    # More requests than stages, so each micro-batch has some; chunked prompts
    # mix prefill and decode micro-batches.
    prompts = [*PROMPTS, [9, 8, 7, 6, 5], [11] * 12, [3, 1, 4, 1, 5, 9, 2, 6]]
    expected = run_single(RunSpec(str(uneven_heads), prompts))
    tokens, events = run_replica(
        tp_size, pp_size, RunSpec(str(uneven_heads), prompts, micro_batches=pp_size)
    )
    assert tokens == {req_id: want.tokens for req_id, want in expected.items()}
    # Stage 0 began a step while the one before it was still in later stages,
    # and steps were answered in order.
    overlapped = [
        step_id
        for index, (kind, step_id) in enumerate(events)
        if kind == "begun" and ("finished", step_id - 1) in events[index + 1 :]
    ]
    assert len(overlapped) >= 3, events
    finished = [step_id for kind, step_id in events if kind == "finished"]
    assert finished == sorted(finished)
    begun_at_once = max(
        sum(1 if kind == "begun" else -1 for kind, _ in events[: i + 1]) for i in range(len(events))
    )
    assert begun_at_once == pp_size


@pytest.mark.parametrize(("tp_size", "pp_size"), [(2, 1), (1, 2), (2, 2)])
def test_lora_in_a_replica_matches_one_process(
    uneven_heads: Path, uneven_adapters: list[str], tp_size: int, pp_size: int, tmp_path: Path
) -> None:
    """Each rank applies its cut of every adapter (B's rows for q/k/v and gate/up,
    A's columns for o and down, its stage's layers); a step mixes two adapters,
    the base model and an adapter nobody can read (failed alone)."""
    all_modules, qv_down = uneven_adapters
    prompts = [*PROMPTS, PROMPTS[0], PROMPTS[1]]
    missing = str(tmp_path / "no-such-adapter")
    loras = (all_modules, qv_down, None, None, missing)
    spec = RunSpec(str(uneven_heads), prompts, chunk_size=8, loras=loras, max_loras=3)
    expected = run_single(spec)
    # The adapters change the output (same prompt: r0 with "all", r3 base), or
    # this test could not tell an adapter dropped on some rank.
    assert expected["r0"].tokens != expected["r3"].tokens
    assert "failed to load" in (expected["r4"].error or "")
    assert_same_outputs(expected, run_replica(tp_size, pp_size, spec))


def test_lora_with_pipeline_overlap_matches_one_process(
    uneven_heads: Path, uneven_adapters: list[str]
) -> None:
    """Two micro-batches in flight over two stages, adapters in both: every rank
    begins steps in the driver's order, so the slots (and the load-error
    gather) stay in step."""
    all_modules, qv_down = uneven_adapters
    prompts = [*PROMPTS, [9, 8, 7, 6, 5], [11] * 12]
    loras = (all_modules, qv_down, None, qv_down, all_modules)
    plain = RunSpec(str(uneven_heads), prompts, loras=loras, max_loras=2)
    expected = {req_id: want.tokens for req_id, want in run_single(plain).items()}
    overlapped = RunSpec(str(uneven_heads), prompts, micro_batches=2, loras=loras, max_loras=2)
    tokens, events = run_replica(1, 2, overlapped)
    assert tokens == expected
    in_flight = [
        sum(1 if kind == "begun" else -1 for kind, _ in events[: i + 1]) for i in range(len(events))
    ]
    assert max(in_flight) == 2  # the stages did overlap


def test_adapter_failing_on_one_rank_fails_on_every_rank(
    uneven_heads: Path, uneven_adapters: list[str]
) -> None:
    """Rank 1 cannot read "qv-down": its requests fail on every rank, so the
    ranks keep the same slots and run the same tokens; the rest is unaffected."""
    all_modules, qv_down = uneven_adapters
    spec = RunSpec(
        str(uneven_heads),
        PROMPTS,
        loras=(all_modules, qv_down, None),
        max_loras=2,
        lora_unreadable=((1, qv_down),),
    )
    expected, actual = run_single(spec), run_replica(2, 1, spec)
    assert expected["r1"].error is None and expected["r1"].tokens
    assert actual["r1"].tokens == []
    assert "is not on this machine" in (actual["r1"].error or "")
    assert_same_outputs(
        {k: v for k, v in expected.items() if k != "r1"},
        {k: v for k, v in actual.items() if k != "r1"},
    )


def test_gguf_codes_shard_like_dense_weights(tmp_path: Path) -> None:
    # Each rank keeps only its shard of the codes: q/k/v, gate/up by rows,
    # o_proj and down by 32-wide column blocks, the Q8_0 embedding by vocab rows.
    make_tiny_checkpoint(
        tmp_path / "ckpt",
        "LlamaForCausalLM",
        torch.float32,
        tie_word_embeddings=True,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=130,
    )
    named, _ = write_tiny_gguf(tmp_path / "ckpt", tmp_path)
    spec = RunSpec(str(named), PROMPTS, chunk_size=8)
    assert_same_outputs(run_single(spec), run_replica(2, 1, spec))


def _broadcast_rank(layout: RankLayout, address: str, messages: list[bytes], out) -> None:
    collectives = Collectives(layout, address, 60, torch.device("cpu"))
    received = [collectives.broadcast_step(m if layout.is_driver else None) for m in messages]
    if layout.is_driver:
        out.put(received == messages)  # the sender's own copy
    else:
        assert received == messages  # a mismatch fails this rank's exit code
    collectives.close()


def test_step_broadcast_carries_small_and_large_messages_whole() -> None:
    # Empty, one chunk exactly full, one byte over (a second broadcast), large.
    messages = [b"", b"a" * (STEP_CHUNK_BYTES - 8), b"b" * (STEP_CHUNK_BYTES - 7), b"xyz" * 50_000]
    assert run_local_replica(_broadcast_rank, 1, 2, (messages,), timeout_s=120)


@pytest.mark.parametrize(("tp_size", "pp_size"), [(2, 1), (1, 2)])
def test_speculative_decoding_in_a_replica_matches_one_process(
    uneven_heads: Path, tp_size: int, pp_size: int
) -> None:
    """n-gram drafts verified by the driver; the other ranks append its accepted
    tokens (a count per row), so every rank's batch stays in step."""
    speculative = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "disable_by_batch_size": 0,
    }
    # The random model rarely repeats itself: 48 tokens give drafts that are
    # mostly rejected (1 token per row) and one accepted (2 tokens).
    prompts = [[5, 6, 7, 8] * 4, [9, 8, 7, 9, 8, 7, 9], [11] * 12, [3, 4] * 6, [1, 2, 3]]
    spec = RunSpec(str(uneven_heads), prompts, speculative=speculative, max_new_tokens=48)
    plain, _ = run_single(RunSpec(str(uneven_heads), prompts, micro_batches=1, max_new_tokens=48))
    expected, [(_, accepted)] = run_single(spec)
    assert expected == plain  # greedy verification keeps greedy output
    assert accepted > 0, "no draft was accepted: the test would not exercise verification"
    tokens, [(_, replica_accepted)] = run_replica(tp_size, pp_size, spec)
    assert tokens == expected
    assert replica_accepted == accepted
