"""A decoder (generation) checkpoint run as a pooling model: no sampling, no
persistent batch, the step's prompts in one causal forward.

vLLM serves a ``*ForCausalLM`` checkpoint as an embedding model under
``--runner pooling`` (``--convert embed``): the final norm's output at the
last token, normalized, is the embedding (Qwen3-Embedding, e5-mistral, gte-Qwen).
It also serves one as a yes/no reranker (Qwen3-Reranker) by ``hf_overrides``:
``classifier_from_token`` names the LM-head rows that become the classifier.

The decoder is the family's own (worker/models/, through its declaration), so
everything generation loads (GGUF, --dtype, --quantization) loads here too.
Its attention is the paged backend's: each step's prompts get contiguous
blocks of a scratch cache that only lives for the step's forward (a pooling
request is whole in one step, so there is nothing to keep between steps and
no prefix to share).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvmesh.kernels.registry import select_attention_backend
from kvmesh.services.contracts.math_utils import cdiv
from kvmesh.worker.config import ModelConfig
from kvmesh.worker.kv_cache import KVCache, allocate_kv_caches
from kvmesh.worker.model_loader import load_model

logger = logging.getLogger(__name__)

# Tokens per block of the scratch cache (any power of two the backends take).
_BLOCK_SIZE = 16
# vLLM's hf_overrides "method" values for classifier_from_token that are implemented.
TOKEN_CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")


@dataclass(frozen=True)
class TokenClassifier:
    """A reranker's score from LM-head rows (vLLM's ``classifier_from_token``).

    Two tokens with ``from_2_way_softmax`` (Qwen3-Reranker's ``["no", "yes"]``):
    one logit, ``logit[yes] - logit[no]``, whose sigmoid is the softmax
    probability of "yes" over the two; ``no_post_processing``: one label per
    token, its raw logit.
    """

    token_ids: tuple[int, ...]
    method: str

    def __post_init__(self) -> None:
        if self.method not in TOKEN_CLASSIFIER_METHODS:
            raise ValueError(
                f"hf_overrides method {self.method!r} is not implemented; "
                f"supported: {TOKEN_CLASSIFIER_METHODS}"
            )
        if self.method == "from_2_way_softmax" and len(self.token_ids) != 2:
            raise ValueError("method from_2_way_softmax needs two classifier_from_token tokens")
        if not self.token_ids:
            raise ValueError("classifier_from_token names no token")

    @property
    def num_labels(self) -> int:
        return 1 if self.method == "from_2_way_softmax" else len(self.token_ids)

    def logits(self, vocab_logits: torch.Tensor) -> torch.Tensor:
        rows = vocab_logits[:, list(self.token_ids)]
        if self.method == "from_2_way_softmax":
            return rows[:, 1:2] - rows[:, 0:1]
        return rows

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any], tokenizer: Any) -> TokenClassifier | None:
        """From hf_overrides (None: it names no classifier_from_token); each token
        string must be one token of the model's tokenizer."""
        tokens = overrides.get("classifier_from_token")
        if not tokens:
            return None
        ids = []
        for token in tokens:
            token_id = tokenizer.convert_tokens_to_ids(str(token))
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise ValueError(f"classifier_from_token {token!r} is not a token of the model")
            ids.append(int(token_id))
        default = "from_2_way_softmax" if len(ids) == 2 else "no_post_processing"
        return cls(tuple(ids), str(overrides.get("method", default)))


class DecoderBackbone:
    """A decoder's final-norm hidden states over a step's packed prompts."""

    def __init__(self, model_config: ModelConfig, device: str = "cpu") -> None:
        self.model_config = model_config
        self.device = torch.device(device)
        self.model = load_model(model_config, self.device)
        self.backend = select_attention_backend(self.device)
        self.hidden_size = model_config.hidden_size
        self.vocab_size = model_config.vocab_size
        self.max_input_tokens = model_config.max_model_len
        # Grown to the largest step seen; K/V of a step is dead once it ran.
        self._kv_caches: list[KVCache] = []
        self._num_blocks = 0

    def _scratch(self, num_blocks: int) -> list[KVCache]:
        if num_blocks > self._num_blocks:
            self._kv_caches = allocate_kv_caches(
                self.model_config, num_blocks, _BLOCK_SIZE, self.device
            )
            self._num_blocks = num_blocks
        return self._kv_caches

    def forward(self, sequences: list[list[int]], rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm states ``[num_tokens, hidden]`` of the packed ``sequences``
        (each attends causally to itself only), or of ``rows`` only (the
        last layer then skips every other row's attention output and MLP)."""
        seq_lens = np.array([len(s) for s in sequences], dtype=np.int64)
        blocks_per_seq = np.array([cdiv(int(n), _BLOCK_SIZE) for n in seq_lens])
        first_block = np.concatenate(([0], np.cumsum(blocks_per_seq)[:-1]))
        num_blocks = int(blocks_per_seq.sum())
        kv_caches = self._scratch(num_blocks)
        query_start_loc = np.concatenate(([0], np.cumsum(seq_lens)))
        num_tokens = int(query_start_loc[-1])
        seq_of_token = np.repeat(np.arange(len(sequences)), seq_lens)
        positions = np.arange(num_tokens) - query_start_loc[:-1][seq_of_token]
        # Sequence i's blocks are first_block[i]..: its slots are contiguous.
        slot_mapping = first_block[seq_of_token] * _BLOCK_SIZE + positions
        max_blocks = int(blocks_per_seq.max())
        block_tables = first_block[:, None] + np.arange(max_blocks)[None, :]
        block_tables = np.minimum(block_tables, num_blocks - 1)  # padding is never read

        def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, dtype)

        metadata = self.backend.build_metadata(
            query_start_loc=tensor(query_start_loc, torch.int32),
            context_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(block_tables, torch.int32),
            slot_mapping=tensor(slot_mapping, torch.int64),
            max_query_len=int(seq_lens.max()),
            max_context_len=int(seq_lens.max()),
        )
        input_ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        hidden = self.model(
            input_ids.to(self.device),
            tensor(positions, torch.int64),
            kv_caches,
            metadata,
            self.backend,
            output_rows=None if rows is None else rows.to(self.device),
        )
        return self.model.final_norm(hidden)

    def vocab_logits(self, states: torch.Tensor) -> torch.Tensor:
        """LM-head logits of final-norm ``states`` (a token classifier's input)."""
        return self.model.lm_head_logits(states)
