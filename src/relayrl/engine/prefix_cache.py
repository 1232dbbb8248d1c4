"""`PrefixCache`: the keys and values of recently finished sequences, found again by their tokens.

An agent's next call is its last prompt, the reply it got and a few new tokens; the episodes of a
GRPO group, and all of a task's episodes, open with the same system prompt and tool list. Without
reuse, every call prefills its whole history again: in the math agent's calls (~400-token
prompts, ~30-token replies) prefill was about 60% of the engine's time. vLLM does the same with
its automatic prefix caching; here it fits the slot cache: a finished sequence's KV row is copied
out, and a later prompt that starts with the same tokens gets those columns copied in and
prefills only the rest.

Lookup walks a chain of hashes of 16-token blocks (each block's hash covers every token before
it), then compares the tokens themselves, so a hash collision can shorten a match but never
reuse the wrong KV. Entries are evicted least recently used within a byte budget, and an entry
whose tokens start a newly stored one is dropped (the new one covers it). Keys and values depend
on the weights: the engine clears the cache at every weight update and stores no sequence that
lived through one.

May import: torch. Nothing else of ours.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

BLOCK = 16
"""Tokens per hashed block: matches are found block by block, then extended token by token."""


@dataclass(eq=False)
class PrefixEntry:
    """One stored sequence: its tokens and, per layer, the KV of those tokens."""

    ids: tuple[int, ...]
    kv: torch.Tensor
    """[layers, 2 * kv_heads, tokens, head_dim]: keys then values, as the slot cache lays them out."""
    hashes: list[int] = field(default_factory=list)
    """The chain hash of each full block of `ids`."""

    @property
    def nbytes(self) -> int:
        """Bytes of KV this entry holds."""
        return self.kv.numel() * self.kv.element_size()


@dataclass
class PrefixStats:
    """What the cache did, counted since the engine started."""

    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    stored: int = 0
    evicted: int = 0
    cleared: int = 0

    @property
    def reuse_rate(self) -> float:
        """Share of looked-up prompt tokens whose KV came from the cache."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def block_hashes(ids: Sequence[int], blocks: int | None = None) -> list[int]:
    """The chain hash of each full 16-token block of `ids` (at most `blocks` of them)."""
    n = len(ids) // BLOCK if blocks is None else min(blocks, len(ids) // BLOCK)
    out: list[int] = []
    h = 0
    for b in range(n):
        h = hash((h, tuple(ids[b * BLOCK:(b + 1) * BLOCK])))
        out.append(h)
    return out


class PrefixCache:
    """Finished sequences' KV, looked up by the longest shared token prefix (see the module)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # id(entry) -> entry, LRU
        self._owner: dict[int, PrefixEntry] = {}  # chain hash -> newest entry holding that block
        self._bytes = 0
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of KV held now (never more than `max_bytes`)."""
        return self._bytes

    def lookup(self, prompt: Sequence[int]) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with `prompt`, and that prefix's length.

        At least one prompt token is always left out of the match: the engine must run it to
        get the logits of the first new token.
        """
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        best, n = self.peek(prompt)
        if best is None:
            return None, 0
        self._entries.move_to_end(id(best))
        self.stats.hits += 1
        self.stats.reused_tokens += n
        return best, n

    def peek(self, prompt: Sequence[int]) -> tuple[PrefixEntry | None, int]:
        """What `lookup` would return, without counting it or refreshing the entry."""
        limit = len(prompt) - 1
        best: PrefixEntry | None = None
        h = 0
        for b in range(limit // BLOCK):
            h = hash((h, tuple(prompt[b * BLOCK:(b + 1) * BLOCK])))
            entry = self._owner.get(h)
            if entry is None:
                break
            best = entry
        if best is None:
            return None, 0
        # The hashes point the way; the tokens decide (a collision only shortens the match).
        n = _common_prefix(best.ids, prompt, min(limit, len(best.ids)))
        return (best, n) if n >= BLOCK else (None, 0)

    def store(self, ids: Sequence[int], kv: torch.Tensor) -> None:
        """Keep `kv` (see `PrefixEntry.kv`, already a copy) for the tokens `ids`."""
        if len(ids) < BLOCK or kv.shape[2] != len(ids):
            return
        entry = PrefixEntry(tuple(ids), kv, block_hashes(ids))
        if entry.nbytes > self.max_bytes:
            return
        # One of two entries whose tokens start the other is redundant: the last turn of a
        # conversation holds the one before.
        near = next((e for h in reversed(entry.hashes) if (e := self._owner.get(h))), None)
        if near is not None:
            if near.ids[:len(entry.ids)] == entry.ids:
                self._entries.move_to_end(id(near))
                return
            if entry.ids[:len(near.ids)] == near.ids:
                self._drop(near)
        for h in entry.hashes:
            self._owner[h] = entry
        self._entries[id(entry)] = entry
        self._bytes += entry.nbytes
        self.stats.stored += 1
        while self._bytes > self.max_bytes and self._entries:  # bounded by the entry count
            _, old = next(iter(self._entries.items()))
            self._drop(old)
            self.stats.evicted += 1

    def clear(self) -> None:
        """Forget everything (the weights changed)."""
        if self._entries:
            self.stats.cleared += 1
        self._entries.clear()
        self._owner.clear()
        self._bytes = 0

    def _drop(self, entry: PrefixEntry) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        self._bytes -= entry.nbytes
        for h in entry.hashes:
            if self._owner.get(h) is entry:
                del self._owner[h]


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of `a` and `b`, at most `limit` (slices compare in C)."""
    lo, hi = 0, limit
    if list(a[:hi]) == list(b[:hi]):
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]; ~log2(limit) rounds
        mid = (lo + hi + 1) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


__all__ = ["BLOCK", "PrefixCache", "PrefixEntry", "PrefixStats", "block_hashes"]
