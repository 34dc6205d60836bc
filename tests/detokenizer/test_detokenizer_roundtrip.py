"""Streamed text must equal one-shot decoding of the same ids, for any step split."""

from __future__ import annotations

import random
import time

import pytest
from tokenizers import Tokenizer

from kvmesh.detokenizer.incremental import IncrementalDetokenizer, InvalidTokenIdError
from kvmesh.services.contracts.sampling_params import DetokenizeParams

REAL_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a: int, b: int) -> int:\n    return a + b\n\n",
    "Café, naïve, résumé, São Paulo, Zürich, Ångström.",
    "日本語のテキストと中文文本，还有한국어 문장.",  # noqa: RUF001
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ✨ sparkles.",
    "Math: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ → ∞.  Tabs\tand  double  spaces.",  # noqa: RUF001
    "<|im_start|>assistant\nHello!<|im_end|>",
]


def stream_text(
    tokenizer: Tokenizer,
    output_ids: list[int],
    params: DetokenizeParams,
    rng: random.Random,
    prompt_ids: list[int] | None = None,
) -> list[str]:
    """Feed ``output_ids`` in random step sizes (0-4 ids) and return every delta's text."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids or [], params)
    deltas: list[str] = []
    pos = 0
    while pos < len(output_ids):
        size = rng.randint(0, 4)
        chunk = output_ids[pos : pos + size]
        pos += len(chunk)
        delta = detok.update(chunk, finished=pos >= len(output_ids))
        deltas.append(delta.text)
    if not output_ids:
        deltas.append(detok.update([], finished=True).text)
    assert detok.finished
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_real_texts_stream_to_their_decoding(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(0)
    params = DetokenizeParams(skip_special_tokens=skip_special_tokens)
    for text in REAL_TEXTS:
        ids = tokenizer.encode(text).ids
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        prompt = tokenizer.encode("User asked: ").ids
        for _ in range(5):
            assert "".join(stream_text(tokenizer, ids, params, rng, prompt)) == expected


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_stream_to_their_decoding(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    # Random ids include lone UTF-8 continuation bytes, special tokens and
    # characters left unfinished at the end; all must match one-shot decode.
    rng = random.Random(1234)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    params = DetokenizeParams(skip_special_tokens=skip_special_tokens)
    num_with_replacement = 0
    for _ in range(300):
        length = rng.randint(0, 40)
        ids = [rng.randrange(vocab_size) for _ in range(length)]
        # Bias towards the byte tokens and special tokens, where bugs live.
        ids += [rng.randrange(0, 300) for _ in range(rng.randint(0, 6))]
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        num_with_replacement += "\ufffd" in expected
        assert "".join(stream_text(tokenizer, ids, params, rng)) == expected
    assert num_with_replacement > 10  # the invalid-UTF-8 paths were exercised


def test_output_ending_mid_character_is_flushed_at_finish(tokenizer: Tokenizer) -> None:
    emoji_ids = tokenizer.encode(" 😀").ids
    assert len(emoji_ids) >= 2
    truncated = [*tokenizer.encode("ok").ids, *emoji_ids[:-1]]
    detok = IncrementalDetokenizer(tokenizer, [], DetokenizeParams())
    held = detok.update(truncated, finished=False)
    assert held.text == "ok"
    flushed = detok.update([], finished=True)
    assert held.text + flushed.text == tokenizer.decode(truncated)
    assert flushed.text.endswith("\ufffd")


def test_prompt_ending_mid_character_does_not_leak_into_output(tokenizer: Tokenizer) -> None:
    emoji_ids = tokenizer.encode("😀").ids
    assert len(emoji_ids) >= 2
    prompt = [*tokenizer.encode("Say").ids, *emoji_ids[:1]]
    output = [*emoji_ids[1:], *tokenizer.encode(" yes").ids]
    text = "".join(stream_text(tokenizer, output, DetokenizeParams(), random.Random(0), prompt))
    assert text == tokenizer.decode(output)
    assert "Say" not in text


def test_special_tokens_are_skipped_or_kept(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id("<|im_end|>")
    ids = [*tokenizer.encode("Hi there").ids, eos]
    kept = IncrementalDetokenizer(tokenizer, [], DetokenizeParams(skip_special_tokens=False))
    skipped = IncrementalDetokenizer(tokenizer, [], DetokenizeParams(skip_special_tokens=True))
    assert kept.update(ids, finished=True).text == "Hi there<|im_end|>"
    assert skipped.update(ids, finished=True).text == "Hi there"


def test_stop_token_text_left_out_unless_included(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id("<|im_end|>")
    ids = [*tokenizer.encode("Done").ids, eos]
    params = DetokenizeParams(skip_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert detok.update(ids, finished=True, stopped_by_token=True).text == "Done"
    include = DetokenizeParams(skip_special_tokens=False, include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [], include)
    assert detok.update(ids, finished=True, stopped_by_token=True).text == "Done<|im_end|>"


def test_token_texts_one_per_new_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello brave new world").ids
    detok = IncrementalDetokenizer(tokenizer, [], DetokenizeParams(), with_token_texts=True)
    delta = detok.update(ids, finished=False)
    assert delta.token_texts == [tokenizer.decode([t]) for t in ids]
    assert "".join(delta.token_texts) == "Hello brave new world"


def test_invalid_token_id_rejected_without_corrupting_state(tokenizer: Tokenizer) -> None:
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    detok = IncrementalDetokenizer(tokenizer, [], DetokenizeParams())
    first = detok.update(tokenizer.encode("Good").ids, finished=False)
    for bad in (vocab_size, -1):
        with pytest.raises(InvalidTokenIdError):
            detok.update([*tokenizer.encode(" x").ids, bad], finished=False)
    rest = detok.update(tokenizer.encode(" morning").ids, finished=True)
    assert first.text + rest.text == "Good morning"


def test_updates_after_finish_add_nothing(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], DetokenizeParams())
    assert detok.update(tokenizer.encode("end").ids, finished=True).text == "end"
    late = detok.update(tokenizer.encode(" more").ids, finished=False)
    assert late.text == "" and late.finished


def test_step_cost_does_not_grow_with_output_length(tokenizer: Tokenizer) -> None:
    # A detokenizer that re-decoded the whole output each step would be ~40x
    # slower on the last block of tokens than on the first one.
    text_ids = tokenizer.encode(" ".join(REAL_TEXTS)).ids
    num_tokens = 24_000
    ids = (text_ids * (num_tokens // len(text_ids) + 1))[:num_tokens]
    block = 600
    detok = IncrementalDetokenizer(tokenizer, [], DetokenizeParams(stop=("STOP!",)))
    block_times: list[float] = []
    for start in range(0, num_tokens, block):
        began = time.perf_counter()
        for token_id in ids[start : start + block]:
            detok.update([token_id], finished=False)
        block_times.append(time.perf_counter() - began)
    early = min(block_times[:5])
    late = min(block_times[-5:])
    assert late < 4 * early, (early, late)
