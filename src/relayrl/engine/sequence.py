"""One request while `LocalEngine` serves it (`SequenceState`), how its prompt finds a prefix to
reuse (`prompt_blocks`, `longest_owner`), and how its tokens reach the caller's event loop from
the engine thread (`emitter`, `emit_all`, `join_chunks`).

Imports: the engine's sampling, stops and prefix cache; relayrl.types.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from relayrl.engine.prefix_cache import BLOCK, PrefixEntry, block_hashes
from relayrl.engine.sampling import RowParams
from relayrl.engine.stops import StopStringMatcher
from relayrl.types import FinishReason, Timings, TokenChunk


@dataclass(eq=False)
class SequenceState:
    """One request while the engine serves it."""

    prompt: list[int]
    row: RowParams
    max_tokens: int
    stop_ids: frozenset[int]
    matcher: StopStringMatcher | None
    submitted: float
    emit: Callable[[TokenChunk | BaseException], None] = lambda item: None
    """Hands an item to the caller's event loop (set once that loop is known)."""
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue[TokenChunk | BaseException] | None = None
    """The caller's loop and queue, for handing over a whole step's tokens at once."""
    output: list[int] = field(default_factory=list)
    cached: int = 0
    """KV columns filled (prompt + all sampled tokens but the last)."""
    last: int = 0
    started: float | None = None
    first_token: float | None = None
    done: bool = False
    aborted: bool = False
    """Set by the caller's side when it stops listening."""
    epoch: int = -1
    """The engine's weight epoch when this sequence's KV was first computed."""
    reuse: tuple[PrefixEntry | None, int, int] | None = None
    """While waiting: the prefix cache's match (entry, tokens) and the epoch it was found in."""
    blocks: list[int] | None = None
    """Chain hashes of the prompt's full blocks (`prefix_cache.block_hashes`), once computed."""

    def finish_after(self, token: int) -> tuple[FinishReason | None, str | None]:
        """Whether the token just appended ends the request, and by which stop string."""
        if token in self.stop_ids:
            return FinishReason.STOP, None
        if self.matcher is not None and (hit := self.matcher.match(self.output)) is not None:
            return FinishReason.STOP, hit
        if len(self.output) >= self.max_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def timings(self, now: float) -> Timings:
        """Timings measured from submission."""
        return Timings(
            queued_s=(self.started or now) - self.submitted,
            first_token_s=(self.first_token or now) - self.submitted,
            total_s=now - self.submitted,
        )


def prompt_blocks(seq: SequenceState) -> list[int]:
    """The chain hashes of the full blocks of `seq`'s prompt (computed once per request)."""
    if seq.blocks is None:
        seq.blocks = block_hashes(seq.prompt)
    return seq.blocks


def longest_owner(seq: SequenceState, owners: Mapping[int, SequenceState]) -> tuple[SequenceState | None, int]:
    """The picked request sharing the most whole blocks with `seq`'s prompt, and how many tokens.

    Only blocks before the prompt's last token count: a cache match always leaves that one out.
    """
    owner: SequenceState | None = None
    blocks = 0
    for b, h in enumerate(prompt_blocks(seq)[: (len(seq.prompt) - 1) // BLOCK]):
        found = owners.get(h)
        if found is None:
            break
        owner, blocks = found, b + 1
    return owner, blocks * BLOCK


def emitter(
    loop: asyncio.AbstractEventLoop,
    queue: asyncio.Queue[TokenChunk | BaseException],
    seq: SequenceState,
) -> Callable[[TokenChunk | BaseException], None]:
    """Deliver items from the engine thread into `queue` on the caller's loop."""

    def emit(item: TokenChunk | BaseException) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            seq.aborted = True

    return emit


def emit_all(chunks: list[tuple[SequenceState, TokenChunk]]) -> None:
    """Hand one step's chunks over with one wake-up per event loop, not one per sequence.

    Each `call_soon_threadsafe` writes to the loop's wake-up pipe: at batch 32 that was 32
    system calls and as many loop wake-ups per decode step.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[SequenceState, TokenChunk]]] = {}
    for seq, chunk in chunks:
        if seq.loop is None:
            seq.emit(chunk)
        else:
            by_loop.setdefault(seq.loop, []).append((seq, chunk))
    for loop, mine in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, mine)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            for seq, _ in mine:
                seq.aborted = True


def _put_all(chunks: list[tuple[SequenceState, TokenChunk]]) -> None:
    for seq, chunk in chunks:
        assert seq.queue is not None
        seq.queue.put_nowait(chunk)


def join_chunks(items: list[TokenChunk | BaseException]) -> TokenChunk:
    """Merge chunks that queued up while the consumer was busy; raise an engine failure."""
    chunks: list[TokenChunk] = []
    for item in items:
        if isinstance(item, BaseException):
            raise item
        chunks.append(item)
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    tops = None
    if last.top_logprobs is not None:
        tops = [t for c in chunks for t in (c.top_logprobs or [])]
    return TokenChunk(
        ids=[t for c in chunks for t in c.ids],
        logprobs=[x for c in chunks for x in c.logprobs],
        versions=[v for c in chunks for v in c.versions],
        top_logprobs=tops,
        finish_reason=last.finish_reason,
        stop_string=last.stop_string,
        timings=last.timings,
    )
