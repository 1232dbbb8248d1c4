"""`LocalEngine`: a Hugging Face causal LM served in this process with continuous batching.

One background thread owns the model and runs the loop: between two decode steps it applies
weight updates, drops finished or abandoned requests, prefills newly arrived ones (several at a
time, left-padded) straight into the batch's KV cache, then runs one decode step for every running
sequence and hands each sampled token to its caller's event loop. Torch releases the GIL inside
its kernels, so the event loop keeps serving while the thread computes.

The parts live beside it: the batch's KV cache (`relayrl.engine.slot_cache`: one row per
running sequence, nothing shifted or concatenated per step), a request's state and the hand-off
of its tokens to the caller's loop (`relayrl.engine.sequence`), the prefix cache
(`relayrl.engine.prefix_cache`), the oneDNN patch (`relayrl.engine.onednn`) and the set-up
helpers (`relayrl.engine.loading`). This module is the engine thread's loop: admission, prefill
(fresh or after reused columns), decode, retirement.

Prefix reuse: a finished sequence's KV row is kept in a `PrefixCache` (512 MB by default), and a
prompt that starts with a kept sequence's tokens (an agent's next turn, another episode's system
prompt and tools) gets those columns copied into its row and prefills only the rest, attending to
them (`_prefill_reused`). The cache is cleared at every weight update, and a sequence that lived
through one is not kept, so reused KV always comes from the weights that sample the next token.
Requests admitted together that share an uncached prefix (a GRPO group's prompt, the system
prompt right after an update) prefill it once: one is picked, its prompt is stored as soon as
it is prefilled, and the others wait a pass to reuse it (`_admit`).
In fp32 the tokens and logprobs equal a full prefill's to 1e-5; in bf16 they differ by rounding,
as a full prefill's do with another batch composition.

Long prompts (a coding CLI opens every episode with 10-25k tokens of system prompt and tools):
a prompt with more than `max_prefill_tokens` tokens left after its cached prefix is prefilled a
chunk of that many tokens per pass, in the cache row after the running batch's, with a decode
step of the batch between two chunks (`_prefill_chunk`), so sequences already decoding wait for
one chunk at a time instead of the whole prompt. One long prompt is chunked at a time; requests
that share its prompt wait until it is prefilled and cached, then prefill only their own tokens.
A single prompt's attention runs SDPA with the causal flag (no mask) from column 0, and a chunk
after cached columns through a [chunk, columns] mask, so prefill never builds the quadratic
[prompt, prompt] mask.

With bf16 on CPU every `nn.Linear` also gets a prepacked oneDNN weight (`pack_linears`): the
same bits, faster products at decode batch sizes.

Decode steps of Llama-family models (Llama, Qwen2, Mistral) skip the model's forward: `LeanDecoder`
(`relayrl.engine.decoder`) runs the same arithmetic on the same weights and cache rows with fewer,
fused ops (same bits, more tokens/s: benchmarks/RESULTS.md), and so does their prefill
(`LeanDecoder.prefill`: products on the prompts' tokens without padding; fp32 logprobs equal the
model's padded prefill to 1e-5). Other architectures run the model. On CPU the decode step
attends with relayrl's compiled kernel, or runs as one compiled call for bias-free models
(`relayrl.kernels`), wherever those build; elsewhere it runs op by op in torch. On CPUs with
AMX, oneDNN's AMX products beat the kernel's AVX512-BF16 ones from about a dozen rows on, so
there a batch that large runs the kernel's pieces (norms, rotary, cache writes, attention,
SwiGLU) around oneDNN's products instead (`relayrl.engine.onednn.amx_products_from`).

bf16 decodes faster than fp32 where the CPU computes bf16 natively (AMX or AVX512-BF16) and
slower where it emulates it, so `dtype="auto"` picks bf16 there
(`relayrl.models.cpu_has_bf16_units`) or on a CUDA GPU with bf16, and fp32 elsewhere.
transformers' own continuous batching (`generate_batch`, paged cache) runs on CPU but slower
than even a static `generate` batch; this loop is several times faster (benchmarks/RESULTS.md).

Logprobs: `log_softmax(logits / T)` of the sampled token (T = 1 for greedy), computed in fp32
from the logits, before top-p/top-k truncation (see `relayrl.engine.sampling`). With a bf16 model
the logits themselves come from bf16 weights; run `dtype="float32"` where logprobs must match an
fp32 forward pass to 1e-4.

Threads: when the engine's OpenMP threads fill every core, any other busy process (a trainer,
the event loop, an agent's tool) makes torch's per-op barriers wait for a descheduled thread:
with one competing busy process a decode step on every core slows several-fold, on one core
less leaves it nearly as it was (benchmarks/bench_contention.py; benchmarks/RESULTS.md). So by
default the engine leaves one core to the rest of the process and the machine
(`default_num_threads`), as vLLM's CPU backend reserves a core for its front end; pass
`num_threads` to use every core on a dedicated machine.

The engine stops a request only at its own `stop_token_ids` / `stop` strings, `max_new_tokens`
or the context length: it adds no end-of-sequence id by itself (the renderer supplies those).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.engine.base import validate_request
from relayrl.engine.decoder import LeanDecoder
from relayrl.engine.loading import (
    default_num_threads,
    describe_decode_path,
    model_context_length,
    pick_dtype,
    read_checkpoint,
)
from relayrl.engine.onednn import amx_products_from, pack_linears
from relayrl.engine.prefix_cache import BLOCK, PrefixCache, PrefixEntry, PrefixStats
from relayrl.engine.sampling import RowParams, sample
from relayrl.engine.sequence import (
    SequenceState,
    emit_all,
    emitter,
    join_chunks,
    longest_owner,
    prompt_blocks,
)
from relayrl.engine.slot_cache import SlotKVCache
from relayrl.engine.stops import StopStringMatcher
from relayrl.errors import EngineError, InvalidRequest, ModelError
from relayrl.kernels import decode_attention_kernel, decode_step_kernel
from relayrl.models import cache_kwarg
from relayrl.types import (
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    TokenChunk,
    TopLogprob,
)

log = logging.getLogger(__name__)


_LIVE_ENGINES: weakref.WeakSet[LocalEngine] = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    # An engine thread still alive while the interpreter finalises can be frozen inside torch as
    # its thread pools are torn down, which aborts the process ("terminate called without an
    # active exception", seen in 1 of 3 exits of a script that never closed its engine).
    for engine in list(_LIVE_ENGINES):
        engine.close(timeout_s=10.0)


@dataclass(eq=False)
class _WeightUpdate:
    state: Mapping[str, torch.Tensor]
    version: int | None
    resolve: Callable[[int | BaseException], None]


class LocalEngine:
    """A transformers causal LM, in-process, with continuous batching (see the module docstring).

    Args:
        device: "cpu", "cuda", ...; default CUDA when available, else CPU.
        dtype: "auto" (bf16 on CPUs with bf16 units and bf16 GPUs, else fp32), "float32" or "bfloat16".
        max_batch_size: most sequences decoded together; later requests wait their turn.
        seed: seeds the random stream of requests that carry no seed of their own.
        max_context: caps the model's context length (prompt + output).
        max_prefill_tokens: padded prompt tokens prefilled together between two decode steps; a
            longer prompt is prefilled in chunks of this many tokens (Llama-family models).
        num_threads: torch threads of the engine thread only (None: `default_num_threads()`).
        prefix_cache_mb: memory for the KV of finished sequences, reused by later prompts that
            start with the same tokens (`relayrl.engine.prefix_cache`); 0 turns reuse off.
    """

    def __init__(
        self,
        model_path: str,
        *,
        device: str | None = None,
        dtype: str = "auto",
        max_batch_size: int = 64,
        seed: int | None = None,
        max_context: int | None = None,
        max_prefill_tokens: int = 4096,
        num_threads: int | None = None,
        prefix_cache_mb: int = 512,
    ) -> None:
        if max_batch_size <= 0:
            raise InvalidRequest(f"max_batch_size must be > 0, got {max_batch_size}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = pick_dtype(dtype, self.device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=self.dtype, attn_implementation="sdpa"
            )
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot load a causal LM from {model_path!r}: {e}") from e
        # transformers wraps `to` with functools.wraps(nn.Module.to), which hides its parameters
        self.model.to(self.device).eval()  # type: ignore[arg-type]
        self.packed_linears = pack_linears(self.model)
        on_cpu = self.device.type == "cpu"
        kernel = decode_attention_kernel() if on_cpu else None
        step_kernel = decode_step_kernel(self.dtype) if on_cpu else None
        # None for architectures it does not reproduce: those decode through the model's forward.
        # On AMX, larger batches take their products from oneDNN (`amx_products_from`).
        products_from = amx_products_from() if self.packed_linears > 0 else None
        self.lean = LeanDecoder.build(self.model, packed=self.packed_linears > 0,
                                      attention=kernel, step_kernel=step_kernel,
                                      products_from=products_from)
        self.lean_prefill = self.lean is not None
        self.decode_path = describe_decode_path(self.lean)
        """How a decode step runs here, in words (logged once: kernels build only where they can)."""
        log.info("LocalEngine: %s on %s, decode %s", str(self.dtype).removeprefix("torch."),
                 self.device, self.decode_path)
        config = self.model.config
        self._vocab_size = int(config.vocab_size)
        self._context_length = model_context_length(config, max_context)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.num_threads = num_threads if num_threads is not None else default_num_threads()
        self._threads_wanted = self.num_threads
        self.threads_in_use = 0
        """Torch threads the engine thread runs its passes on now (0 before it starts)."""
        self._targets = dict(self.model.state_dict())
        self._version = 0
        self._shared_generator = torch.Generator().manual_seed(
            seed if seed is not None else secrets.randbits(63)
        )
        self._cache = SlotKVCache(config.num_hidden_layers, max_batch_size, self._context_length)
        self._cache_arg = cache_kwarg(self.model)
        self._prefixes = PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb > 0 else None
        self._epoch = 0
        """Counts applied weight updates: KV computed in an older epoch is stale."""
        self._columns = torch.arange(self._context_length, device=self.device)
        # State shared with callers, guarded by `_wakeup`.
        self._wakeup = threading.Condition()
        self._inbox: collections.deque[SequenceState] = collections.deque()
        self._updates: collections.deque[_WeightUpdate] = collections.deque()
        self._closing = False
        # State owned by the engine thread.
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._rows: list[SequenceState] = []
        self._partial: SequenceState | None = None
        """A long prompt being prefilled chunk by chunk (`_prefill_chunk`), or None."""
        self._partial_row = 0
        """The cache row of `_partial`: always the one after the running batch's rows."""
        self._thread = threading.Thread(
            target=self._serve, name="relayrl-local-engine", daemon=True
        )
        self._thread.start()
        _LIVE_ENGINES.add(self)

    @property
    def version(self) -> int:
        """Weight version that samples the next token."""
        return self._version

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + output) one sequence may hold."""
        return self._context_length

    @property
    def prefix_stats(self) -> PrefixStats | None:
        """What the prefix cache reused so far (None when it is off)."""
        return self._prefixes.stats if self._prefixes is not None else None

    def set_threads(self, threads: int | None) -> None:
        """Torch threads for the engine's passes from its next one on; None: `num_threads`.

        For a phase where nothing else computes in this process (a held-out eval): the engine
        then has the cores the trainer's update otherwise takes.
        """
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        self._threads_wanted = threads or self.num_threads

    @property
    def active(self) -> int:
        """Requests queued or in the running batch."""
        partial = 1 if self._partial is not None else 0
        return len(self._inbox) + len(self._waiting) + len(self._rows) + partial

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample a whole completion."""
        return GenerateOutput.from_chunks([c async for c in self.stream(request)])

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Sample a completion, yielding tokens as they are sampled; bad requests raise here."""
        validate_request(request, self._context_length, self._vocab_size)
        if self._closing:
            raise EngineError("the engine is closed")
        return self._stream(request)

    async def update_weights(
        self, weights: Mapping[str, Any] | str | os.PathLike[str], version: int | None = None
    ) -> int:
        """Load new weights (a state dict or a checkpoint directory) between decode steps."""
        if isinstance(weights, str | os.PathLike):
            state = await asyncio.to_thread(read_checkpoint, str(weights))
        else:
            state = {k: torch.as_tensor(v) for k, v in weights.items()}
        self._check_state(state)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()

        def resolve(result: int | BaseException) -> None:
            def settle() -> None:
                if done.done():
                    return
                if isinstance(result, BaseException):
                    done.set_exception(result)
                else:
                    done.set_result(result)

            loop.call_soon_threadsafe(settle)

        with self._wakeup:
            if self._closing:
                raise EngineError("the engine is closed")
            self._updates.append(_WeightUpdate(state, version, resolve))
            self._wakeup.notify()
        return await done

    async def aclose(self) -> None:
        """Stop serving; requests in flight finish with `abort`."""
        await asyncio.to_thread(self.close)

    def close(self, timeout_s: float | None = None) -> None:
        """Blocking form of `aclose`, for code without an event loop."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        self._thread.join(timeout_s)

    # -- caller side -------------------------------------------------------------------------

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        seq = self._new_sequence(request)
        seq.emit = emitter(loop, queue, seq)
        seq.loop, seq.queue = loop, queue
        with self._wakeup:
            if self._closing:
                raise EngineError("the engine is closed")
            self._inbox.append(seq)
            self._wakeup.notify()
        finished = False
        try:
            # One chunk per sampled token at most, plus the final one.
            for _ in range(seq.max_tokens + 1):
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                chunk = join_chunks(items)
                finished = chunk.finish_reason is not None
                yield chunk
                if finished:
                    return
        finally:
            if not finished:
                seq.aborted = True
                with self._wakeup:
                    self._wakeup.notify()

    def _decode_all(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens included (what stop strings are matched against)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    def _new_sequence(self, request: GenerateRequest) -> SequenceState:
        p = request.params
        prompt = list(request.prompt_ids)
        generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        matcher = None
        if p.stop:
            matcher = StopStringMatcher(p.stop, self._decode_all)
        return SequenceState(
            prompt=prompt,
            row=RowParams(p.temperature, p.top_p, p.top_k, p.top_logprobs, generator),
            # The context bounds the output too: finish "length" at its end.
            max_tokens=min(p.max_new_tokens, self._context_length - len(prompt)),
            stop_ids=frozenset(p.stop_token_ids),
            matcher=matcher,
            submitted=time.perf_counter(),
        )

    def _check_state(self, state: Mapping[str, torch.Tensor]) -> None:
        unknown = [k for k in state if k not in self._targets]
        if unknown:
            raise InvalidRequest(
                f"{len(unknown)} weight names are not in the model, e.g. {unknown[:3]}"
            )
        wrong = [k for k, t in state.items() if t.shape != self._targets[k].shape]
        if wrong:
            k = wrong[0]
            raise InvalidRequest(
                f"weight {k!r} has shape {tuple(state[k].shape)}, "
                f"the model expects {tuple(self._targets[k].shape)}"
            )

    # -- engine thread -----------------------------------------------------------------------

    def _serve(self) -> None:
        with torch.inference_mode():
            while self._next_iteration():
                # OpenMP's thread count is a per-thread setting: the callers' are untouched.
                if self.threads_in_use != self._threads_wanted:
                    self.threads_in_use = self._threads_wanted
                    torch.set_num_threads(self.threads_in_use)
                try:
                    self._admit()
                    if self._partial is not None:
                        self._prefill_chunk()
                    if self._rows:
                        self._decode()
                except Exception as e:  # a failed pass must not kill the engine
                    self._fail_batch(e)
        self._shut_down()

    def _next_iteration(self) -> bool:
        """Wait for work; take arrivals and weight updates. False once the engine closes."""
        with self._wakeup:
            while not (
                self._inbox or self._updates or self._rows or self._waiting or self._closing
                or self._partial is not None
            ):
                self._wakeup.wait()
            if self._closing:
                return False
            self._waiting.extend(self._inbox)
            self._inbox.clear()
            updates = list(self._updates)
            self._updates.clear()
        for update in updates:
            self._apply_update(update)
        self._retire()
        return True

    def _apply_update(self, update: _WeightUpdate) -> None:
        try:
            for name, tensor in update.state.items():
                self._targets[name].copy_(tensor)
        except Exception as e:  # e.g. a tensor on a device we cannot read
            update.resolve(EngineError(f"weight update failed: {e}"))
            return
        self._version = update.version if update.version is not None else self._version + 1
        self._epoch += 1
        if self._prefixes is not None:
            self._prefixes.clear()  # keys and values of the old weights
        update.resolve(self._version)

    def _admit(self) -> None:
        """Prefill waiting requests into free rows, within the prefill token budget.

        Requests whose prompt starts with a cached prefix prefill only the rest, in a pass of
        their own; the budget counts the padded tokens of both passes. A request that shares at
        least a block more with a prompt picked in this pass than with the cache waits for the
        next pass, when that prompt is in the cache.

        A prompt with more than `max_prefill_tokens` tokens left to prefill (after its cached
        prefix) becomes the partial sequence, prefilled a chunk per pass (`_prefill_chunk`); one
        at a time, and requests sharing its prompt wait until it is cached.
        """
        fresh: list[SequenceState] = []
        reused: list[SequenceState] = []
        fresh_width = reused_width = 0
        partial = self._partial
        room = self.max_batch_size - len(self._rows) - (partial is not None)
        # Requests that arrive together often share a prompt prefix that is not cached yet (a
        # GRPO group's episodes, every episode's system prompt after a weight update cleared
        # the cache). One of them prefills it; the others wait one pass and then reuse it.
        owners: dict[int, SequenceState] = {}  # chain hash of a picked prompt's block -> that request
        wanted: list[SequenceState] = []  # picked requests whose prompts deferred ones will reuse
        deferred: list[SequenceState] = []
        if partial is not None and self._prefixes is not None:
            for h in prompt_blocks(partial):
                owners.setdefault(h, partial)
        started: SequenceState | None = None
        while self._waiting and len(fresh) + len(reused) + (started is not None) < room:
            seq = self._waiting[0]
            if seq.aborted:
                self._waiting.popleft()
                continue
            if owners:
                owner, shared = longest_owner(seq, owners)
                if owner is not None and shared >= self._reusable(seq) + BLOCK:
                    self._waiting.popleft()
                    seq.reuse = None  # an earlier pass's match would miss the owner's prompt
                    deferred.append(seq)
                    if not any(w is owner for w in wanted):
                        wanted.append(owner)
                    continue
            entry, n = self._match(seq)
            work = len(seq.prompt) - n
            if self.lean_prefill and work > self.max_prefill_tokens:
                if partial is not None or started is not None:
                    break  # one long prompt at a time; this one keeps its place in the queue
                self._waiting.popleft()
                started = seq
                if self._prefixes is not None:
                    for h in prompt_blocks(seq):
                        owners.setdefault(h, seq)
                continue
            if entry is None:
                cost = max(fresh_width, work) * (len(fresh) + 1) + reused_width * len(reused)
            else:
                cost = fresh_width * len(fresh) + max(reused_width, work) * (len(reused) + 1)
            if (fresh or reused) and cost > self.max_prefill_tokens:
                break
            self._waiting.popleft()
            if entry is None:
                fresh.append(seq)
                fresh_width = max(fresh_width, work)
            else:
                reused.append(seq)
                reused_width = max(reused_width, work)
            if self._prefixes is not None:
                for h in prompt_blocks(seq):
                    owners.setdefault(h, seq)
        self._waiting.extendleft(reversed(deferred))
        if partial is not None and (fresh or reused):
            # New rows join the batch right after its last row: the partial row moves past them.
            self._move_partial(len(self._rows) + len(fresh) + len(reused))
        if fresh:
            self._prefill(fresh, fresh_width)
        if reused:
            self._prefill_reused(reused, reused_width)
        if started is not None:
            self._start_partial(started)
        if wanted:
            self._store_prompts(wanted)

    def _move_partial(self, row: int) -> None:
        """Move the partial sequence's prefilled columns to cache row `row`."""
        assert self._partial is not None
        if row != self._partial_row:
            self._cache.reserve(row + 1, len(self._partial.prompt) + 1)
            self._cache.buffers()
            self._cache.move_row(self._partial_row, row, self._partial.cached)
            self._partial_row = row

    def _start_partial(self, seq: SequenceState) -> None:
        """Make `seq` the partial sequence, in the row after the batch, its cached prefix loaded."""
        assert self.lean is not None and self._partial is None
        row = len(self._rows)
        entry, n = seq.reuse[:2] if seq.reuse is not None else (None, 0)
        self._cache.reserve(row + 1, len(seq.prompt) + 1)
        like = torch.empty(1, self.lean.kv_heads, 1, self.lean.head_dim, dtype=self.dtype,
                           device=self.device)
        self._cache.buffers(like)
        if entry is not None:
            self._cache.load_row(row, entry.kv, n)
        seq.started = time.perf_counter()
        seq.cached = n if entry is not None else 0
        seq.epoch = self._epoch
        seq.reuse = None
        self._partial, self._partial_row = seq, row

    def _prefill_chunk(self) -> None:
        """Prefill the partial sequence's next `max_prefill_tokens` prompt tokens; after the
        last chunk it joins the batch with its first token sampled.

        Decode steps of the running batch run between chunks, so a 16k-token prompt stalls
        them for one chunk at a time, not for its whole prefill.
        """
        seq = self._partial
        assert seq is not None and self.lean is not None
        if seq.aborted:
            self._partial = None
            return
        start = seq.cached
        end = min(len(seq.prompt), start + self.max_prefill_tokens)
        row = self._partial_row
        assert row == len(self._rows)
        self._cache.reserve(row + 1, len(seq.prompt) + 1)
        ids_T = torch.tensor(seq.prompt[start:end], device=self.device)
        logits_N_V = self.lean.prefill(ids_T, row, [start], [end - start], self._cache.buffers())
        seq.cached = end
        if end < len(seq.prompt):
            return
        self._partial = None
        if (self._prefixes is not None and seq.epoch == self._epoch
                and len(seq.prompt) >= BLOCK):
            # Kept now, not only when it finishes: requests sharing it are waiting for it.
            self._prefixes.store(seq.prompt, self._cache.save_row(row, len(seq.prompt)))
        self._rows.append(seq)
        self._advance([seq], logits_N_V)
        self._retire()

    def _store_prompts(self, seqs: list[SequenceState]) -> None:
        """Keep the just-prefilled prompts of `seqs` in the prefix cache (for deferred requests)."""
        assert self._prefixes is not None
        rows = {id(s): i for i, s in enumerate(self._rows)}
        for s in seqs:
            i = rows.get(id(s))
            # a request that already finished was stored whole when it retired
            if i is not None and s.epoch == self._epoch and len(s.prompt) >= BLOCK:
                self._prefixes.store(s.prompt, self._cache.save_row(i, len(s.prompt)))

    def _match(self, seq: SequenceState) -> tuple[PrefixEntry | None, int]:
        """The prefix cache's match for `seq`'s prompt, looked up once per weight epoch."""
        if self._prefixes is None:
            return None, 0
        if seq.reuse is None or seq.reuse[2] != self._epoch:
            entry, n = self._prefixes.lookup(seq.prompt)
            seq.reuse = (entry, n, self._epoch)
        return seq.reuse[0], seq.reuse[1]

    def _reusable(self, seq: SequenceState) -> int:
        """Prompt tokens of `seq` the prefix cache holds now (not counted as a lookup)."""
        assert self._prefixes is not None
        if seq.reuse is not None and seq.reuse[2] == self._epoch:
            return seq.reuse[1]
        return self._prefixes.peek(seq.prompt)[1]

    def _prefill_reused(self, seqs: list[SequenceState], width: int) -> None:
        """Copy each sequence's cached prefix into its row, then prefill the rest of its prompt."""
        first = len(self._rows)
        # `_admit` passes only sequences whose reuse it looked up (`reuse` is set)
        starts = [s.reuse[1] for s in seqs]  # type: ignore[index]
        lengths = [len(s.prompt) - n for s, n in zip(seqs, starts, strict=True)]
        visible = max(len(s.prompt) for s in seqs)  # columns attention reads in this pass
        self._cache.reserve(first + len(seqs), visible + 1)
        for i, s in enumerate(seqs):
            entry = s.reuse[0]  # type: ignore[index]  # set, as above
            assert entry is not None
            self._cache.load_row(first + i, entry.kv, starts[i])
        if self.lean_prefill:
            self._prefill_lean(seqs, starts)
            return
        self._cache.plan_extend(first, starts, lengths, width)
        starts_N = torch.tensor(starts)
        pads_N = width - torch.tensor(lengths)
        cols_W = torch.arange(width)
        # query j of row i is prompt token starts[i] + j - pads[i] (left padding before it)
        positions_N_W = (starts_N[:, None] + cols_W[None, :] - pads_N[:, None]).clamp_(min=0)
        real_N_W = cols_W[None, :] >= pads_N[:, None]
        keys_V = torch.arange(visible)
        mask_N_W_V = keys_V[None, None, :] <= positions_N_W[:, :, None]
        # padding queries read column 0 only, so no query is fully masked (that gives NaN)
        mask_N_W_V &= real_N_W[:, :, None] | (keys_V == 0)[None, None, :]
        ids_N_W = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, (s, start) in enumerate(zip(seqs, starts, strict=True)):
            ids_N_W[i, width - lengths[i]:] = torch.tensor(s.prompt[start:])
        now = time.perf_counter()
        for s in seqs:
            s.started = now
            s.cached = len(s.prompt)
            s.epoch = self._epoch
            s.reuse = None  # the entry's KV is copied; let it go
        self._rows.extend(seqs)
        out = self.model(
            input_ids=ids_N_W.to(self.device),
            attention_mask=mask_N_W_V[:, None].to(self.device),
            position_ids=positions_N_W.to(self.device),
            **{self._cache_arg: self._cache},
            use_cache=True,
            logits_to_keep=1,
        )
        self._advance(seqs, out.logits[:, -1])
        self._retire()

    def _prefill(self, seqs: list[SequenceState], width: int) -> None:
        first = len(self._rows)
        if self.lean_prefill:
            self._cache.reserve(first + len(seqs), width + 1)
            self._prefill_lean(seqs, [0] * len(seqs))
            return
        pads = [width - len(s.prompt) for s in seqs]
        ids_N_L = torch.tensor([[0] * pad + s.prompt for pad, s in zip(pads, seqs, strict=True)])
        pads_N = torch.tensor(pads)
        cols_L = torch.arange(width)
        positions_N_L = (cols_L[None, :] - pads_N[:, None]).clamp_(min=0)
        causal_L_L = cols_L[None, :] <= cols_L[:, None]
        # Padding rows attend to themselves only, so no row is fully masked (that gives NaN).
        mask_N_L_L = (causal_L_L[None] & (cols_L[None, None, :] >= pads_N[:, None, None])) | (
            torch.eye(width, dtype=torch.bool)[None]
        )
        self._cache.reserve(first + len(seqs), width + 1)
        self._cache.plan_prefill([(first + i, pad, width - pad) for i, pad in enumerate(pads)])
        now = time.perf_counter()
        for s in seqs:
            s.started = now
            s.cached = len(s.prompt)
            s.epoch = self._epoch
            s.reuse = None
        self._rows.extend(seqs)
        out = self.model(
            input_ids=ids_N_L.to(self.device),
            attention_mask=mask_N_L_L[:, None].to(self.device),
            position_ids=positions_N_L.to(self.device),
            **{self._cache_arg: self._cache},
            use_cache=True,
            logits_to_keep=1,
        )
        self._advance(seqs, out.logits[:, -1])
        self._retire()

    def _prefill_lean(self, seqs: list[SequenceState], starts: list[int]) -> None:
        """Prefill through `LeanDecoder` into the next rows (room reserved, reused columns loaded)."""
        assert self.lean is not None
        first = len(self._rows)
        lean = self.lean
        like = torch.empty(1, lean.kv_heads, 1, lean.head_dim, dtype=self.dtype, device=self.device)
        caches = self._cache.buffers(like)
        lengths = [len(s.prompt) - n for s, n in zip(seqs, starts, strict=True)]
        ids = [t for s, n in zip(seqs, starts, strict=True) for t in s.prompt[n:]]
        now = time.perf_counter()
        for s in seqs:
            s.started = now
            s.cached = len(s.prompt)
            s.epoch = self._epoch
            s.reuse = None  # a reused entry's KV is copied; let it go
        self._rows.extend(seqs)
        ids_T = torch.tensor(ids, device=self.device)
        logits_N_V = lean.prefill(ids_T, first, starts, lengths, caches)
        self._advance(seqs, logits_N_V)
        self._retire()

    def _decode(self) -> None:
        rows = self._rows
        cached = [s.cached for s in rows]
        visible = max(cached) + 1
        cols_B = torch.tensor(cached, device=self.device)
        self._cache.reserve(len(rows), visible)
        ids_B = torch.tensor([s.last for s in rows], device=self.device)
        if self.lean is not None:
            # Rows of equal length see every column: no mask, the cheaper attention path.
            mask_B_V = None
            if min(cached) != visible - 1:
                mask_B_V = self._columns[None, :visible] <= cols_B[:, None]
            logits_B_V = self.lean.step(
                ids_B, cols_B, self._cache.buffers(), visible, mask_B_V, cached
            )
        else:
            self._cache.plan_decode(cols_B, visible)
            mask_B_V = self._columns[None, :visible] <= cols_B[:, None]
            out = self.model(
                input_ids=ids_B[:, None],
                attention_mask=mask_B_V[:, None, None, :],
                position_ids=cols_B[:, None],
                **{self._cache_arg: self._cache},
                use_cache=True,
            )
            logits_B_V = out.logits[:, -1]
        for s in rows:
            s.cached += 1
        self._advance(rows, logits_B_V)
        self._retire()

    def _advance(self, seqs: list[SequenceState], logits_B_V: torch.Tensor) -> None:
        """Sample one token for each of `seqs` (aligned with the logits' rows) and emit it."""
        picked = sample(logits_B_V, [s.row for s in seqs], self._shared_generator)
        now = time.perf_counter()
        version = self._version
        chunks: list[tuple[SequenceState, TokenChunk]] = []
        for i, s in enumerate(seqs):
            token = picked.token_ids[i]
            s.output.append(token)
            s.last = token
            if s.first_token is None:
                s.first_token = now
            finish, stop_string = s.finish_after(token)
            tops = None
            if s.row.top_logprobs > 0:
                tops = [[TopLogprob(t, lp) for t, lp in picked.top_logprobs[i]]]
            chunk = TokenChunk(
                ids=[token],
                logprobs=[picked.logprobs[i]],
                versions=[version],
                top_logprobs=tops,
                finish_reason=finish,
                stop_string=stop_string,
                timings=s.timings(now) if finish is not None else None,
            )
            chunks.append((s, chunk))
            s.done = finish is not None
        emit_all(chunks)

    def _retire(self) -> None:
        """Remove finished and abandoned rows, filling holes with rows from the end."""
        rows = self._rows
        # One snapshot: `aborted` may flip on the caller's thread while we rearrange.
        dead = [s.done or s.aborted for s in rows]
        keep = dead.count(False)
        if keep == len(rows):
            return
        if self._prefixes is not None:
            for i, s in enumerate(rows):
                if dead[i] and s.epoch == self._epoch and s.cached >= BLOCK:
                    ids = (s.prompt + s.output)[: s.cached]
                    self._prefixes.store(ids, self._cache.save_row(i, s.cached))
        if keep == 0 and self._partial is None:
            self._rows = []
            self._cache.clear()
            return
        holes = [i for i in range(keep) if dead[i]]
        movers = [i for i in range(keep, len(rows)) if not dead[i]]
        for hole, mover in zip(holes, movers, strict=True):
            self._cache.move_row(mover, hole, rows[mover].cached)
            rows[hole] = rows[mover]
        removed = len(rows) - keep
        del rows[keep:]
        if self._partial is not None:
            # It stays after the batch's rows (and after rows a prefill is about to fill).
            self._move_partial(self._partial_row - removed)

    def _fail_batch(self, error: Exception) -> None:
        failure = EngineError(f"the engine failed during a forward pass: {error!r}")
        for s in self._rows:
            if not (s.done or s.aborted):
                s.emit(failure)
        if self._partial is not None and not self._partial.aborted:
            self._partial.emit(failure)
        self._rows = []
        self._partial = None
        self._cache.clear()

    def _shut_down(self) -> None:
        with self._wakeup:
            pending = [*self._rows, *self._waiting, *self._inbox]
            if self._partial is not None:
                pending.append(self._partial)
            updates = list(self._updates)
            self._inbox.clear()
            self._updates.clear()
        now = time.perf_counter()
        for s in pending:
            if not (s.done or s.aborted):
                s.emit(
                    TokenChunk([], [], [], finish_reason=FinishReason.ABORT, timings=s.timings(now))
                )
        for update in updates:
            update.resolve(EngineError("the engine closed before the weight update was applied"))
        self._rows = []
        self._partial = None
        self._waiting.clear()
        self._cache.clear()
