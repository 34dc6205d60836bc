"""Suffix decoding: drafts from the longest match of the context's suffix, in the
request's own tokens or in the outputs of recent requests.

After Arctic's SuffixDecoding (and vLLM's ``"method": "suffix"``): agentic and
templated workloads repeat what earlier requests wrote, which prompt lookup
(one request's own tokens) cannot see. Each live request has a suffix automaton
over its prompt + output; the shared corpus holds the outputs of recent
requests. The longest match wins and earns ``max_spec_factor`` drafts per
matched token, so a weak one-token match proposes little.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvmesh.scheduler.spec_decode.suffix_automaton import SuffixAutomaton

# A one-token match is a unigram guess: on text that does not repeat (measured
# on random prompts) such drafts are almost never accepted.
MIN_MATCH_LENGTH = 2


class RecentOutputs:
    """The outputs of about the last ``max_requests`` requests, with bounded memory.

    A suffix automaton cannot forget, so the corpus lives in two generations:
    new outputs go into the current automaton; when it holds half the budget it
    becomes the previous one and the old previous one is dropped. Memory stays
    within ``max_requests`` outputs; matching looks at both. Each output ends
    with its own negative separator, so no match runs from one into the next.
    """

    def __init__(self, max_requests: int) -> None:
        self.per_generation = max(1, max_requests // 2)
        self.current = SuffixAutomaton()
        self.previous: SuffixAutomaton | None = None
        self._num_current = 0
        self._next_separator = -1

    def add(self, output_token_ids: Sequence[int]) -> None:
        if not output_token_ids:
            return
        self.current.extend(output_token_ids)
        self.current.append(self._next_separator)
        self._next_separator -= 1
        self._num_current += 1
        if self._num_current >= self.per_generation:
            self.previous, self.current = self.current, SuffixAutomaton()
            self._num_current = 0

    def automata(self) -> Iterator[SuffixAutomaton]:
        yield self.current
        if self.previous is not None:
            yield self.previous


class SuffixProposer:
    """Per-request automata plus the shared corpus; one ``propose`` per decode step."""

    def __init__(self, max_depth: int, max_spec_factor: float, max_cached_requests: int) -> None:
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.recent = RecentOutputs(max_cached_requests)
        self._automata: dict[str, SuffixAutomaton] = {}

    @property
    def num_requests(self) -> int:
        return len(self._automata)

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        if max_drafts <= 0:
            return []
        automaton = self._automata.get(request_id)
        if automaton is None:
            automaton = self._automata[request_id] = SuffixAutomaton()
        # Prompt + output only grow: catch up with the tokens appended since.
        automaton.extend(token_ids[len(automaton) :])
        best_length, best_end = automaton.longest_repeated_suffix()
        best_tokens: list[int] = automaton.tokens
        query = token_ids[-self.max_depth :]
        for corpus in self.recent.automata():
            length, end = corpus.longest_suffix_match(query)
            if length > best_length:
                best_length, best_end, best_tokens = length, end, corpus.tokens
        if best_length < MIN_MATCH_LENGTH:
            return []
        num_drafts = min(max_drafts, int(self.max_spec_factor * min(best_length, self.max_depth)))
        if num_drafts <= 0:
            return []
        drafts = best_tokens[best_end + 1 : best_end + 1 + num_drafts]
        for i, token in enumerate(drafts):
            if token < 0:  # a separator: the matched output ended there
                return drafts[:i]
        return drafts

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The request is done: drop its automaton, learn its output."""
        self._automata.pop(request_id, None)
        self.recent.add(output_token_ids)
