"""Multi-byte characters split across byte-level tokens stream only when complete."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from kvmesh.detokenizer.incremental import IncrementalDetokenizer
from kvmesh.services.contracts.sampling_params import DetokenizeParams

CANDIDATE_TEXTS = [
    "I love it 😀 so much 🎉!",
    "漢字と仮名、東京都庁舎、鬱蒼とした森",
    "生僻字：龘靐齉爨，还有𠀀𪚥",  # noqa: RUF001
    "Ærøskøbing, Þingvellir, Œuvre, Ŝtono, Żółć, Ǆemal",
    "Skin tones 👍🏽 and families 👨‍👩‍👧 and flags 🇧🇷",
    "Ελληνικά και русский текст, עברית",
]


def has_split_character(tokenizer: Tokenizer, ids: list[int]) -> bool:
    """Whether some character's bytes span several tokens (a lone token decodes to U+FFFD)."""
    return any("\ufffd" in tokenizer.decode([token_id]) for token_id in ids[:-1])


@pytest.fixture(scope="module")
def split_cases(tokenizer: Tokenizer) -> list[tuple[list[int], str]]:
    encoded = [(tokenizer.encode(text).ids, text) for text in CANDIDATE_TEXTS]
    cases = [(ids, text) for ids, text in encoded if has_split_character(tokenizer, ids)]
    # Without such cases the test below would pass vacuously.
    assert len(cases) >= 4, "expected the BPE to split multi-byte characters across tokens"
    return cases


def test_no_partial_character_is_ever_streamed(
    tokenizer: Tokenizer, split_cases: list[tuple[list[int], str]]
) -> None:
    for ids, text in split_cases:
        detok = IncrementalDetokenizer(tokenizer, [], DetokenizeParams())
        streamed = ""
        num_silent_steps = 0
        for i, token_id in enumerate(ids):
            delta = detok.update([token_id], finished=i == len(ids) - 1)
            assert "\ufffd" not in delta.text, (text, i)
            num_silent_steps += delta.text == ""
            streamed += delta.text
            # What has been streamed is always a prefix of the final text.
            assert text.startswith(streamed)
        assert streamed == text
        assert num_silent_steps > 0  # some token really was held back


def test_character_appears_with_its_last_byte(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a😀").ids
    emoji_pieces = [tokenizer.decode([t]) for t in ids[1:]]
    assert len(ids) >= 3 and all(p == "\ufffd" for p in emoji_pieces)
    detok = IncrementalDetokenizer(tokenizer, [], DetokenizeParams())
    texts = [detok.update([t], finished=False).text for t in ids]
    assert texts[0] == "a"
    assert texts[1:-1] == [""] * (len(ids) - 2)
    assert texts[-1] == "😀"
