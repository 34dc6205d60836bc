"""Tiny random-weight encoder checkpoints in sentence-transformers folder layout.

Built in the test (no download): a WordPiece tokenizer trained on a few
sentences with ``tokenizers``, random BERT / XLM-RoBERTa weights from
transformers, and sentence-transformers' own ``save`` for the pooling
pipeline (Pooling, Dense, Normalize modules), so the folder is exactly what
a user downloads for bge / e5 / all-MiniLM style models.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is the capital of france? paris is the capital of france.",
    "embeddings turn text into vectors for search and retrieval",
    "a reranker scores how well a document answers a query",
    "hello world, this is a test of the tokenizer with numbers 123 and 456",
]


def wordpiece_tokenizer(vocab_size: int = 300, segment_ids: bool = True):
    """A BERT-style fast tokenizer ([CLS] a [SEP] b [SEP]) trained on CORPUS.

    ``segment_ids``: return token_type_ids as BertTokenizerFast does (a pair's second
    text gets type 1); False as XLM-R's tokenizer, which returns none."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(
        CORPUS * 20, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special)
    )
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
        model_input_names=(
            ["input_ids", "token_type_ids", "attention_mask"]
            if segment_ids
            else ["input_ids", "attention_mask"]
        ),
    )


def _hf_config(family: str, vocab_size: int, hidden: int, layers: int, heads: int, **extra):
    from transformers import BertConfig, XLMRobertaConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden * 4,
        **extra,
    )
    if family == "bert":
        return BertConfig(max_position_embeddings=512, **common)
    # The tokenizer pads with id 0; XLM-R numbers positions after its pad id.
    return XLMRobertaConfig(
        max_position_embeddings=514, pad_token_id=0, type_vocab_size=1, **common
    )


def build_embedding_model(
    folder: Path,
    family: str = "bert",
    pooling: str = "mean",
    dense_dim: int | None = 24,
    normalize: bool = True,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
) -> Path:
    """A sentence-transformers embedding model folder; returns it."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_models
    from transformers import BertModel, XLMRobertaModel

    tokenizer = wordpiece_tokenizer(segment_ids=family == "bert")
    config = _hf_config(family, len(tokenizer), hidden, layers, heads)
    torch.manual_seed(seed)
    model = (BertModel if family == "bert" else XLMRobertaModel)(config)
    hf_dir = folder.parent / f"{folder.name}-hf"
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    modules: list[torch.nn.Module] = [
        st_models.Transformer(str(hf_dir)),
        st_models.Pooling(hidden, pooling_mode=pooling),
    ]
    if dense_dim is not None:
        modules.append(st_models.Dense(hidden, dense_dim, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(st_models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


RERANKER_INIT_RANGE = 0.3


def build_cross_encoder(
    folder: Path, family: str = "bert", hidden: int = 32, layers: int = 2, heads: int = 4
) -> Path:
    """A one-label cross-encoder (reranker) folder; returns it."""
    from transformers import BertForSequenceClassification, XLMRobertaForSequenceClassification

    tokenizer = wordpiece_tokenizer(segment_ids=family == "bert")
    # At the default 0.02 init the [CLS] state barely depends on the other tokens, so every
    # pair scored within 1e-5 of 0.5 and the ranking was float noise (it differed between
    # CPUs). A wider init makes the scores, and so the ranking tests, mean something.
    config = _hf_config(
        family,
        len(tokenizer),
        hidden,
        layers,
        heads,
        num_labels=1,
        initializer_range=RERANKER_INIT_RANGE,
    )
    torch.manual_seed(1)
    cls = BertForSequenceClassification if family == "bert" else XLMRobertaForSequenceClassification
    model = cls(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
