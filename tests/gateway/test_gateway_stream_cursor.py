"""A replayed stream continues where the reader is: no duplicate, no missing character."""

from __future__ import annotations

from kvmesh.gateway.engine.stream_cursor import StreamCursor

# An undisturbed stream's outputs: (text, token ids), with held-back text
# (an incomplete character, then a possible stop-string prefix) released later.
STREAM = [("Hé", [1, 2]), ("", [3]), ("llo wö", [4, 5]), ("rld", [6]), ("!", [7])]
FULL_TEXT = "Héllo wörld!"
ALL_TOKENS = [1, 2, 3, 4, 5, 6, 7]


def _replay(upto: int) -> tuple[str, list[int]]:
    """A new detokenizer's replay of the first ``upto`` outputs: their text and tokens at once."""
    return (
        "".join(text for text, _ in STREAM[:upto]),
        [t for _, ids in STREAM[:upto] for t in ids],
    )


def test_a_replay_from_any_point_completes_the_stream_exactly() -> None:
    for delivered in range(len(STREAM) + 1):
        for replayed in range(delivered, len(STREAM) + 1):
            cursor = StreamCursor()
            texts, tokens = [], []
            for text, ids in STREAM[:delivered]:
                new = cursor.advance(text, ids, None, replay=False)
                texts.append(new.text)
                tokens += new.token_ids
            text, ids = _replay(replayed)
            new = cursor.advance(text, ids, None, replay=True)
            texts.append(new.text)
            tokens += new.token_ids
            for text, ids in STREAM[replayed:]:
                new = cursor.advance(text, ids, None, replay=False)
                texts.append(new.text)
                tokens += new.token_ids
            assert "".join(texts) == FULL_TEXT, (delivered, replayed)
            assert tokens == ALL_TOKENS and cursor.token_ids == ALL_TOKENS


def test_a_replay_shorter_than_what_was_delivered_holds_until_it_catches_up() -> None:
    cursor = StreamCursor()
    for text, ids in STREAM[:3]:
        cursor.advance(text, ids, None, replay=False)
    # The new detokenizer still holds "llo wö" back: nothing new yet, then the rest.
    assert cursor.advance("Hé", [1, 2, 3, 4, 5], None, replay=True).text == ""
    assert cursor.advance("llo wörld", [6], None, replay=False).text == "rld"


def test_logprobs_follow_only_the_tokens_the_reader_lacks() -> None:
    cursor = StreamCursor()
    assert cursor.advance("a", [1], ["lp1"], replay=False).first
    # A replay of tokens 1..3 whose logprobs cover only the step's new token (3).
    new = cursor.advance("abc", [1, 2, 3], ["lp3"], replay=True)
    assert new.token_ids == [2, 3] and new.logprobs == ["lp3"] and not new.first
    new = cursor.advance("d", [4], ["lp4"], replay=False)
    assert new.token_ids == [4] and new.logprobs == ["lp4"]


def test_after_a_resubscription_outputs_before_the_replay_are_dropped() -> None:
    """The gateway subscribed again after the new detokenizer's first replay went
    out: that detokenizer's next outputs continue a state the reader never saw
    (here it had replayed "Héllo wö"), so they are dropped until the replay the
    gateway asked for, which covers them."""
    cursor = StreamCursor()
    delivered = "".join(cursor.advance(t, ids, None, replay=False).text for t, ids in STREAM[:1])
    cursor.await_replay()
    dropped = cursor.advance("rld", [6], None, replay=False)
    assert (dropped.text, dropped.token_ids) == ("", [])
    text, ids = _replay(4)
    rest = cursor.advance(text, ids, None, replay=True).text
    rest += cursor.advance("!", [7], None, replay=False).text
    assert delivered + rest == FULL_TEXT and cursor.token_ids == ALL_TOKENS
