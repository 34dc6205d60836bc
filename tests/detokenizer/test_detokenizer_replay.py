"""A restarted detokenizer rebuilds a request from its tokens so far; a lost scheduler
is announced to every gateway."""

from __future__ import annotations

from kvmesh.detokenizer.registry import DetokenizerTable
from kvmesh.detokenizer.service import DetokenizerEngine
from kvmesh.gateway.engine.stream_cursor import StreamCursor
from kvmesh.protos import common_pb2, scheduler_pb2

TEXT = "Héllo wörld — naïve café, 日本語 text, and more words to decode."


def _outputs(
    tokens: list[int], replay_from: int | None = None
) -> list[scheduler_pb2.RequestOutput]:
    """One output per token; the first carries the header (with the tokens before
    ``replay_from`` as output so far when replaying)."""
    start = replay_from or 0
    header = scheduler_pb2.RequestHeader(
        prompt_token_ids=[1, 2], client_id="gw", output_token_ids=tokens[:start]
    )
    outs = []
    for index in range(start, len(tokens)):
        last = index == len(tokens) - 1
        out = scheduler_pb2.RequestOutput(
            request_id="r",
            new_token_ids=[tokens[index]],
            finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
        )
        if index == start:
            out.header.CopyFrom(header)
        outs.append(out)
    return outs


def _run(engine: DetokenizerEngine, outputs, cursor: StreamCursor) -> str:
    text = ""
    for step_id, out in enumerate(outputs, 1):
        per_client, _ = engine.process_step(
            scheduler_pb2.StepOutputs(step_id=step_id, outputs=[out])
        )
        for msg in per_client.get("gw", []):
            text += cursor.advance(msg.text, list(msg.token_ids), None, msg.replay).text
    return text


def test_a_new_detokenizer_continues_the_text_without_a_duplicate_or_gap(tokenizer) -> None:
    tokens = tokenizer.encode(TEXT, add_special_tokens=False).ids
    expected = _run(
        DetokenizerEngine(DetokenizerTable(tokenizer), ""), _outputs(tokens), StreamCursor()
    )
    assert expected == TEXT
    for cut in range(1, len(tokens) - 1):
        cursor = StreamCursor()
        delivered = _run(
            DetokenizerEngine(DetokenizerTable(tokenizer), ""), _outputs(tokens)[:cut], cursor
        )
        # Restarted: republished from the first token, a few steps later than delivered.
        replayed_upto = min(cut + 2, len(tokens) - 1)
        new = DetokenizerEngine(DetokenizerTable(tokenizer), "")
        rest = _run(new, _outputs(tokens, replay_from=replayed_upto), cursor)
        assert delivered + rest == TEXT, cut
        assert cursor.token_ids == tokens
        assert len(new.table) == 0  # finished: state released


def test_a_lost_scheduler_is_announced_to_every_gateway(tokenizer) -> None:
    engine = DetokenizerEngine(DetokenizerTable(tokenizer), "")
    busy, idle = engine.subscribe("busy"), engine.subscribe("idle")
    out = _outputs([5, 6, 7])[0]
    out.header.client_id = "busy"
    engine.process_step(scheduler_pb2.StepOutputs(step_id=1, outputs=[out]))
    assert len(engine.table) == 1
    engine._announce_scheduler_lost()
    assert len(engine.table) == 0
    for subscription in (busy, idle):
        batch = subscription.queue.get_nowait()
        assert batch.scheduler_lost and not batch.outputs
