"""`SlotKVCache`: the KV cache of `LocalEngine`'s running batch, one row per sequence.

Each row holds its sequence's tokens from column 0 ("right-padded"), with a 4D boolean mask and
per-row position ids. A joining sequence is written into a free row and a finished one leaves by
moving the last row into its place, so nothing is ever shifted or concatenated per step
(transformers' DynamicCache concatenates every layer's cache at every step, which grows with the
batch). Keys and values of a layer are the two halves of one buffer (`_SlotLayer.both`), so a
decode step stores both with one copy. The tradeoff: memory is rows x longest live sequence, not
the sum of lengths (paged attention would fix that; it is not worth its complexity at CPU batch
sizes).

Imports: torch, transformers' cache base classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

_MIN_COLUMNS = 256
"""Smallest KV-cache width allocated; it doubles as sequences grow."""


@dataclass
class _Plan:
    """What the current forward pass writes into the cache (shared by all layers)."""

    rows_cap: int = 0
    cols_cap: int = 0
    past: int = 0
    """Columns visible before this pass (decode) or 0 (prefill)."""
    visible: int = 0
    """Columns attention reads in this pass (decode)."""
    write_cols_B: torch.Tensor | None = None
    """Decode: the column each row writes its new token to."""
    rows_B: torch.Tensor | None = None
    placements: list[tuple[int, int, int]] = field(default_factory=list)
    """Prefill: (cache row, left padding, prompt length) per input row."""
    extend: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None = None
    """Prefill after reused columns: (cache rows, cache columns, input rows, input columns) of
    every new token, then the first cache row and the number of rows."""


class _SlotLayer(CacheLayerMixin):
    """One layer's keys/values: row r holds its sequence's tokens in columns [0, length_r)."""

    is_sliding = False

    def __init__(self, plan: _Plan) -> None:
        super().__init__()
        self._plan = plan
        self.both: torch.Tensor | None = None
        """[rows, 2 * kv_heads, columns, head_dim]: `keys` and `values` are its two halves."""

    def buffer(self) -> torch.Tensor:
        """`both`, which a prefill allocated (a cache read before any prefill is a bug)."""
        if self.both is None:
            raise RuntimeError("this cache layer holds no buffer yet: nothing was prefilled")
        return self.both

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate (or grow) the buffers to the plan's capacity, keeping what they hold."""
        _, heads, _, dim = key_states.shape
        # Keys and values are two halves of one buffer, so a decode step writes both in one copy.
        shape = (self._plan.rows_cap, 2 * heads, self._plan.cols_cap, dim)
        old_k, old_v = self.keys, self.values
        self.both = key_states.new_zeros(shape)
        self.keys, self.values = self.both[:, :heads], self.both[:, heads:]
        if old_k is not None and old_v is not None:
            r, c = old_k.shape[0], old_k.shape[2]
            self.keys[:r, :, :c] = old_k
            self.values[:r, :, :c] = old_v
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this pass's keys/values; return what attention should read."""
        plan = self._plan
        if (
            self.keys is None
            or self.keys.shape[0] < plan.rows_cap
            or self.keys.shape[2] < plan.cols_cap
        ):
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        if plan.extend is not None:
            rows_P, cols_P, in_rows_P, in_cols_P, first, n = plan.extend
            self.keys[rows_P, :, cols_P] = key_states[in_rows_P, :, in_cols_P]
            self.values[rows_P, :, cols_P] = value_states[in_rows_P, :, in_cols_P]
            return (self.keys[first : first + n, :, : plan.visible],
                    self.values[first : first + n, :, : plan.visible])
        if plan.write_cols_B is None:
            self._store_prefill(key_states, value_states)
            # Prefill attends within its own (left-padded) block: nothing older is involved.
            return key_states, value_states
        self.keys[plan.rows_B, :, plan.write_cols_B] = key_states[:, :, 0]
        self.values[plan.rows_B, :, plan.write_cols_B] = value_states[:, :, 0]
        batch = key_states.shape[0]
        return self.keys[:batch, :, : plan.visible], self.values[:batch, :, : plan.visible]

    def _store_prefill(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        assert self.keys is not None and self.values is not None
        placements = self._plan.placements
        first, _, length = placements[0]
        if all(p[1] == 0 and p[0] == first + i for i, p in enumerate(placements)):
            # No padding and consecutive rows: one copy for the whole block.
            self.keys[first : first + len(placements), :, :length] = key_states
            self.values[first : first + len(placements), :, :length] = value_states
            return
        for i, (row, pad, length) in enumerate(placements):
            self.keys[row, :, :length] = key_states[i, :, pad:]
            self.values[row, :, :length] = value_states[i, :, pad:]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Length and offset of the keys a pass of `query_length` tokens attends to."""
        return self._plan.past + query_length, 0

    def get_seq_length(self) -> int:
        """Columns cached before this pass."""
        return self._plan.past

    def get_max_length(self) -> int:
        """No fixed maximum: the buffers grow."""
        return -1

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row `src`'s first `length` columns into row `dst`."""
        if self.keys is not None and self.values is not None:
            self.keys[dst, :, :length] = self.keys[src, :, :length]
            self.values[dst, :, :length] = self.values[src, :, :length]


class SlotKVCache(Cache):
    """KV cache with one row per running sequence; see the module docstring."""

    def __init__(self, num_layers: int, max_rows: int, max_columns: int) -> None:
        self._plan = _Plan()
        self._slots = [_SlotLayer(self._plan) for _ in range(num_layers)]
        super().__init__(layers=list(self._slots))
        self._max_rows = max_rows
        self._max_columns = max_columns

    def reserve(self, rows: int, columns: int) -> None:
        """Make room for `rows` sequences of `columns` tokens (grows by doubling)."""
        plan = self._plan
        if rows > plan.rows_cap:
            plan.rows_cap = min(self._max_rows, max(rows, 2 * plan.rows_cap, 4))
        if columns > plan.cols_cap:
            plan.cols_cap = min(self._max_columns, max(columns, 2 * plan.cols_cap, _MIN_COLUMNS))

    def plan_prefill(self, placements: list[tuple[int, int, int]]) -> None:
        """Next pass is a prefill; input row i goes to cache row placements[i][0]."""
        self._plan.placements = placements
        self._plan.write_cols_B = None
        self._plan.extend = None
        self._plan.past = 0

    def plan_extend(self, first: int, starts: list[int], lengths: list[int], width: int) -> None:
        """Next pass prefills, into rows first.., `lengths[i]` tokens (left-padded to `width`)
        after the `starts[i]` columns each row already holds; attention reads all of them."""
        rows: list[int] = []
        cols: list[int] = []
        in_rows: list[int] = []
        in_cols: list[int] = []
        for i, (start, length) in enumerate(zip(starts, lengths, strict=True)):
            pad = width - length
            rows += [first + i] * length
            cols += range(start, start + length)
            in_rows += [i] * length
            in_cols += range(pad, width)
        plan = self._plan
        plan.extend = (torch.tensor(rows), torch.tensor(cols), torch.tensor(in_rows),
                       torch.tensor(in_cols), first, len(starts))
        plan.write_cols_B = None
        plan.visible = max(s + n for s, n in zip(starts, lengths, strict=True))
        plan.past = plan.visible - width

    def load_row(self, row: int, kv: torch.Tensor, columns: int) -> None:
        """Copy the first `columns` of stored KV ([layers, 2 * kv_heads, tokens, head_dim]) into
        cache row `row`, growing the buffers to the plan first."""
        for i, layer in enumerate(self._slots):
            heads = kv.shape[1] // 2
            like = kv[i, :heads, :1].unsqueeze(0)
            if (layer.keys is None or layer.keys.shape[0] < self._plan.rows_cap
                    or layer.keys.shape[2] < self._plan.cols_cap):
                layer.lazy_initialization(like, like)
            assert layer.both is not None
            layer.both[row, :, :columns] = kv[i, :, :columns]

    def save_row(self, row: int, columns: int) -> torch.Tensor:
        """A copy of row `row`'s first `columns` of KV, as `load_row` takes it."""
        return torch.stack([layer.buffer()[row, :, :columns] for layer in self._slots])

    def plan_decode(self, write_cols_B: torch.Tensor, visible: int) -> None:
        """Next pass decodes one token per row, written at `write_cols_B`."""
        plan = self._plan
        plan.write_cols_B = write_cols_B
        plan.extend = None
        if plan.rows_B is None or plan.rows_B.shape[0] != write_cols_B.shape[0]:
            plan.rows_B = torch.arange(write_cols_B.shape[0], device=write_cols_B.device)
        plan.visible = visible
        plan.past = visible - 1

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy one sequence's cache from row `src` to row `dst`."""
        for layer in self._slots:
            layer.move_row(src, dst, length)

    def buffers(self, like: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every layer's key+value buffer (see `_SlotLayer.both`), grown to the plan first.

        `like` ([1, kv_heads, 1, head_dim], the cache's dtype) allocates buffers not made yet.
        """
        plan = self._plan
        for layer in self._slots:
            if layer.keys is None and like is not None:
                layer.lazy_initialization(like, like)
            assert layer.keys is not None and layer.values is not None  # a prefill made them
            if layer.keys.shape[0] < plan.rows_cap or layer.keys.shape[2] < plan.cols_cap:
                layer.lazy_initialization(layer.keys, layer.values)
        return [x.buffer() for x in self._slots]

    def clear(self) -> None:
        """Free every buffer (the batch is empty)."""
        for layer in self._slots:
            layer.keys = layer.values = layer.both = None
            layer.is_initialized = False
        self._plan.rows_cap = self._plan.cols_cap = 0
