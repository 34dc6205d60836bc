"""Stop-string matching over streamed text, with a hold-back buffer.

Text arrives in chunks; a stop string may be split across any number of them.
Text that could still turn out to be the start of a stop string is held back
(never streamed) until the next chunk proves it is not, so a client never sees
half of a stop string that later gets cut.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopScan:
    """What one scan of the unsent text decided."""

    # Text that may be streamed now.
    emit: str
    # Text kept back for the next scan (empty once the stream is over).
    held: str
    # The stop string that ended the stream, if any.
    stop_string: str | None


class StopStringMatcher:
    """Finds the first stop string in streamed text and decides what is safe to emit."""

    def __init__(self, stop: tuple[str, ...], include_stop_str_in_output: bool) -> None:
        # An empty stop string would match before any text; it means nothing.
        self._stop = tuple(dict.fromkeys(s for s in stop if s))
        self._include_stop = include_stop_str_in_output

    @property
    def max_hold_chars(self) -> int:
        """The most characters ever held back (longest stop string minus one)."""
        return max((len(s) for s in self._stop), default=1) - 1

    def scan(self, unsent: str, final: bool) -> StopScan:
        """Split ``unsent`` (all text not yet streamed) into emit / held / stop.

        ``unsent`` must hold every character after the last emitted one; the
        hold-back guarantees no stop string can start before it.
        """
        match = self._earliest_match(unsent)
        if match is not None:
            start, stop_string = match
            end = start + len(stop_string) if self._include_stop else start
            return StopScan(emit=unsent[:end], held="", stop_string=stop_string)
        if final:
            return StopScan(emit=unsent, held="", stop_string=None)
        num_held = self._partial_suffix_len(unsent)
        split = len(unsent) - num_held
        return StopScan(emit=unsent[:split], held=unsent[split:], stop_string=None)

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        # Earliest *end* wins: that is the stop string a character-by-character
        # generator would have hit first ("ab" beats "abc" in "abc"). On equal
        # ends the one starting earlier wins, so neither appears in the output.
        best: tuple[int, int, str] | None = None
        for stop_string in self._stop:
            start = text.find(stop_string)
            if start < 0:
                continue
            key = (start + len(stop_string), start, stop_string)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        return best[1], best[2]

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop_string in self._stop:
            for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
                if text.endswith(stop_string[:length]):
                    longest = length
                    break
        return longest
