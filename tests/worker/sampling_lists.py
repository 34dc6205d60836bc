"""Sampling metadata for rows written as plain token lists, as the sampler tests need."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvmesh.services.contracts.sampling_params import SamplingParams
from kvmesh.worker.sampling_metadata import SamplingMetadata, build_sampling_metadata


def sampling_metadata_from_lists(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    generators: Mapping[int, torch.Generator],
    eos_token_ids: Sequence[int],
    vocab_size: int,
) -> SamplingMetadata:
    """The metadata for rows given as token lists, without a persistent batch."""
    prompt_lens = np.array([len(p) for p in prompt_token_ids], dtype=np.int64)
    num_tokens = prompt_lens + np.array([len(o) for o in output_token_ids], dtype=np.int64)
    token_ids = np.full((len(params), max(1, int(num_tokens.max(initial=0)))), 0, dtype=np.int64)
    for row, (prompt, output) in enumerate(zip(prompt_token_ids, output_token_ids, strict=True)):
        token_ids[row, : num_tokens[row]] = list(prompt) + list(output)
    return build_sampling_metadata(
        params, token_ids, prompt_lens, num_tokens, generators, eos_token_ids, vocab_size
    )
