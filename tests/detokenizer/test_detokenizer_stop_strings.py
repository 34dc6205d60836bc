"""Stop strings: found across token boundaries, never streamed partially."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from kvmesh.detokenizer.incremental import DetokenizedDelta, IncrementalDetokenizer
from kvmesh.detokenizer.stop_strings import StopStringMatcher
from kvmesh.services.contracts.sampling_params import DetokenizeParams

TEXT = "The quick brown fox jumps over the lazy dog."


def tokens_spanned(tokenizer: Tokenizer, ids: list[int], start: int, end: int) -> int:
    """How many tokens cover the characters [start, end) of decode(ids)."""
    bounds = [len(tokenizer.decode(ids[:i])) for i in range(len(ids) + 1)]
    return sum(1 for i in range(len(ids)) if bounds[i] < end and bounds[i + 1] > start)


def run(
    tokenizer: Tokenizer,
    text: str,
    params: DetokenizeParams,
    steps_of: int = 1,
) -> tuple[list[DetokenizedDelta], int]:
    """Stream ``text``'s tokens until the detokenizer finishes; return deltas and ids used."""
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Q: ").ids, params)
    deltas = []
    pos = 0
    while not detok.finished:
        chunk = ids[pos : pos + steps_of]
        pos += len(chunk)
        deltas.append(detok.update(chunk, finished=pos >= len(ids)))
    return deltas, pos


def streamed(deltas: list[DetokenizedDelta]) -> str:
    return "".join(d.text for d in deltas)


@pytest.mark.parametrize(
    ("stop", "num_tokens"),
    [("uic", 1), ("ick bro", 2), ("ick brown f", 3)],
)
def test_stop_string_found_within_and_across_tokens(
    tokenizer: Tokenizer, stop: str, num_tokens: int
) -> None:
    ids = tokenizer.encode(TEXT).ids
    start = TEXT.index(stop)
    assert tokens_spanned(tokenizer, ids, start, start + len(stop)) == num_tokens
    deltas, _ = run(tokenizer, TEXT, DetokenizeParams(stop=(stop,)))
    assert streamed(deltas) == TEXT[:start]
    assert deltas[-1].stop_string == stop and deltas[-1].finished
    assert all(d.stop_string is None for d in deltas[:-1])


def test_stream_stops_at_the_token_that_completes_the_stop(tokenizer: Tokenizer) -> None:
    stop = "brown fox"
    _, num_fed = run(tokenizer, TEXT, DetokenizeParams(stop=(stop,)))
    ids = tokenizer.encode(TEXT).ids
    assert tokenizer.decode(ids[:num_fed]).endswith(stop)
    assert num_fed < len(ids)


def test_stop_string_in_very_first_token(tokenizer: Tokenizer) -> None:
    deltas, num_fed = run(tokenizer, TEXT, DetokenizeParams(stop=("The",)))
    assert num_fed == 1
    assert deltas == [DetokenizedDelta("", None, "The", True)]


@pytest.mark.parametrize("steps_of", [1, 2, 5, 100])
def test_include_stop_str_in_output(tokenizer: Tokenizer, steps_of: int) -> None:
    params = DetokenizeParams(stop=("fox",), include_stop_str_in_output=True)
    deltas, _ = run(tokenizer, TEXT, params, steps_of)
    assert streamed(deltas) == "The quick brown fox"
    assert deltas[-1].stop_string == "fox"


@pytest.mark.parametrize("steps_of", [1, 3, 100])
def test_text_after_stop_in_same_step_is_dropped(tokenizer: Tokenizer, steps_of: int) -> None:
    deltas, _ = run(tokenizer, TEXT, DetokenizeParams(stop=(" jumps",)), steps_of)
    assert streamed(deltas) == "The quick brown fox"


def test_overlapping_stops_shorter_completes_first(tokenizer: Tokenizer) -> None:
    text = "It says abcdef here"
    for stop in [("abc", "ab"), ("ab", "abc")]:
        deltas, _ = run(tokenizer, text, DetokenizeParams(stop=stop))
        assert deltas[-1].stop_string == "ab"
        assert streamed(deltas) == "It says "
    params = DetokenizeParams(stop=("abc", "ab"), include_stop_str_in_output=True)
    deltas, _ = run(tokenizer, text, params, steps_of=100)
    assert streamed(deltas) == "It says ab"


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    for stop in [("lazy", "fox", "quick"), ("quick", "lazy", "fox")]:
        deltas, _ = run(tokenizer, TEXT, DetokenizeParams(stop=stop), steps_of=100)
        assert deltas[-1].stop_string == "quick"
        assert streamed(deltas) == "The "


def test_possible_stop_prefix_held_back_then_flushed_at_finish(tokenizer: Tokenizer) -> None:
    text = "Wait for the STO"
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, [], DetokenizeParams(stop=("STOP",)))
    before = detok.update(ids, finished=False)
    assert before.text == "Wait for the "
    after = detok.update([], finished=True)
    assert after.text == "STO" and after.stop_string is None and after.finished


def test_held_back_text_released_when_it_cannot_be_a_stop(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], DetokenizeParams(stop=("STOP",)))
    assert detok.update(tokenizer.encode("Go ST").ids, finished=False).text == "Go "
    assert detok.update(tokenizer.encode("ART now").ids, finished=False).text == "START now"


def test_stop_strings_independent_of_step_split(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    words = TEXT.split()
    for _ in range(40):
        stops = tuple(
            words[i][rng.randrange(len(words[i])) :] + " " + words[i + 1][: rng.randint(1, 3)]
            for i in rng.sample(range(len(words) - 1), 2)
        )
        outputs = set()
        for steps_of in (1, 2, 3, 50):
            deltas, _ = run(tokenizer, TEXT, DetokenizeParams(stop=stops), steps_of)
            outputs.add((streamed(deltas), deltas[-1].stop_string))
        assert len(outputs) == 1, stops
        text, stop_string = outputs.pop()
        assert stop_string in stops
        assert TEXT.startswith(text + stop_string)


def reference_output(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Grow the text one character at a time and stop at the first completed stop."""
    for end in range(1, len(text) + 1):
        completed = [s for s in stops if text[:end].endswith(s)]
        if completed:
            stop = max(completed, key=len)  # on equal ends the longest starts earliest
            return text[: end - len(stop)], stop
    return text, None


def test_matcher_against_character_by_character_reference() -> None:
    rng = random.Random(99)
    alphabet = "ab c"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        stops = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        )
        matcher = StopStringMatcher(stops, include_stop_str_in_output=False)
        emitted, held, stop_string, pos = "", "", None, 0
        while stop_string is None and pos < len(text):
            size = rng.randint(1, 5)
            chunk, pos = text[pos : pos + size], pos + size
            scan = matcher.scan(held + chunk, final=pos >= len(text))
            emitted += scan.emit
            held, stop_string = scan.held, scan.stop_string
            assert len(held) <= matcher.max_hold_chars
            # Streamed text is never retracted: it is a prefix of the final output.
            assert reference_output(text, stops)[0].startswith(emitted)
        assert (emitted, stop_string) == reference_output(text, stops), (text, stops)
