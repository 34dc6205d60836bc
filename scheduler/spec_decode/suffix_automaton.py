"""An online suffix automaton over token ids: every substring, O(n) states.

The automaton of a sequence S recognizes exactly the substrings of S; each
state stands for the substrings that end at the same set of positions, and
``first_end`` keeps the first of those positions, so the tokens that followed a
matched substring are ``tokens[first_end + 1:]``. Built one token at a time
(Blumer et al. 1985) in amortized O(1) per token, it is a compact stand-in for
the suffix tree that suffix decoding matches against: a suffix tree of the
reversed sequence has the same states.
"""

from __future__ import annotations

from collections.abc import Sequence


class SuffixAutomaton:
    """Append-only; ``tokens`` is the sequence it indexes (do not mutate)."""

    __slots__ = ("first_end", "last", "length", "link", "next", "tokens")

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        # Per state: outgoing transitions, suffix link, longest substring length
        # and the first position where its substrings end. State 0 is the root.
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.first_end: list[int] = [-1]
        self.last = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_states(self) -> int:
        return len(self.length)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def _new_state(self, length: int, first_end: int, link: int, nxt: dict[int, int]) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.first_end.append(first_end)
        return len(self.length) - 1

    def append(self, token: int) -> None:
        nxt, link, length = self.next, self.link, self.length
        position = len(self.tokens)
        self.tokens.append(token)
        cur = self._new_state(length[self.last] + 1, position, 0, {})
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                # q also stands for longer strings that do not end here: split
                # off the short ones into a clone that does.
                clone = self._new_state(length[p] + 1, self.first_end[q], link[q], dict(nxt[q]))
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def longest_repeated_suffix(self) -> tuple[int, int]:
        """(length, first end) of the longest suffix that also occurs earlier; (0, -1) if none.

        The suffix link of the whole sequence's state is exactly that suffix,
        and its first end lies before the last position, so a continuation exists.
        """
        state = self.link[self.last] if self.last else -1
        if state <= 0:
            return 0, -1
        return self.length[state], self.first_end[state]

    def longest_suffix_match(self, query: Sequence[int]) -> tuple[int, int]:
        """(length, first end) of the longest suffix of ``query`` found in the
        sequence; (0, -1) if not even its last token occurs."""
        nxt, link, length = self.next, self.link, self.length
        state = matched = 0
        for token in query:
            while state and token not in nxt[state]:
                state = link[state]
                matched = length[state]
            target = nxt[state].get(token)
            if target is None:
                state = matched = 0
            else:
                state = target
                matched += 1
        if matched == 0:
            return 0, -1
        return matched, self.first_end[state]
