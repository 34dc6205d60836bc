"""Prompt lookup: propose what followed the last occurrence of the request's latest n-gram."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Stateless n-gram lookup over one request's prompt + output.

    For n from ``max_n`` down to ``min_n``: if the last n tokens occurred
    earlier, the tokens that followed their most recent earlier occurrence are
    the drafts (the most recent one: in "repeat/edit this text" and in code,
    the latest repetition is the likeliest to continue the same way). The search
    is one vectorized comparison per n over the whole sequence, a few
    microseconds for thousands of tokens, so no per-request index is kept.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        num_tokens = len(token_ids)
        if max_drafts <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # Windows that start early enough to be followed by a token: the
            # suffix itself (the last window) is not among them.
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start : start + max_drafts].tolist()
        return []
