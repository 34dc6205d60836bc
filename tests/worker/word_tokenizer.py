"""A word-level tokenizer over a tiny random checkpoint's vocabulary ("w0".. "wN"),
with "no" and "yes" among its tokens (a yes/no reranker's classifier tokens)."""

from __future__ import annotations

from pathlib import Path

NO_ID, YES_ID = 11, 42


def save_word_tokenizer(folder: Path, vocab_size: int) -> dict[str, int]:
    """Save tokenizer files into ``folder``; returns the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab = {("no" if i == NO_ID else "yes" if i == YES_ID else w): i for w, i in vocab.items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(folder)
    return vocab
