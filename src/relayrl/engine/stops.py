"""Stop-string detection over a growing list of sampled token ids, shared by every engine here.

Engines sample ids, but stop strings are text. Decoding the whole output after each token costs
O(n²) over a long completion; decoding only a tail window that is long enough to hold any stop
string costs O(1) per token. The tradeoff: a stop string is found when it ends inside the newest
tokens, which is exactly when it first appears, since the check runs after every token.
Torch-free, so the scripted `FakeEngine` can use it too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_BYTES_PER_CHAR = 4
"""A character can span up to 4 byte-fallback tokens (UTF-8), so a stop string of n characters
lies within the last 4n tokens (+ one token it may start inside)."""


class StopStringMatcher:
    """Finds the first stop string in the decoded tail of a sequence of output ids."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        self.stops = tuple(stops)
        self._decode = decode
        self._window = _BYTES_PER_CHAR * max((len(s) for s in self.stops), default=0) + 2

    def match(self, output_ids: list[int]) -> str | None:
        """The stop string that the text of `output_ids` now contains, if any."""
        if not self.stops:
            return None
        tail = self._decode(output_ids[-self._window :])
        found = [(tail.find(s) + len(s), i) for i, s in enumerate(self.stops) if s in tail]
        # The occurrence that ends first is the one the text reached first.
        return self.stops[min(found)[1]] if found else None
