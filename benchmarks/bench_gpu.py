"""LocalEngine and `Actor.update` on a CUDA GPU, against transformers on the same GPU.

Run by hand on a GPU machine:  python -m benchmarks gpu [--model NAME] [--out FILE]

vLLM is what a GPU user would pick for serving; it was not installable on the GPU machine this
was written for (no network there), so the baseline here is transformers on the same GPU:
`generate` one request at a time and one static left-padded batch, greedy, bf16. Rows:
  - LocalEngine (its default dtype on CUDA: bf16) at 1, 8 and 32 concurrent requests of
    `--new-tokens` tokens each (no stop ids), logprobs recorded as always; best of
    `--repeats` interleaved rounds, with the transformers rows in the same rounds;
  - `Actor.update` (bf16 copy of fp32 masters, the default) on bench_train's 16-row batch shaped
    like the main job's episodes, and on its shared-prefix agent batch, each with unpadded
    micro-batches (the default `packing`) and padded ones, interleaved (the best of each), and
    the rows without a shared prefix unpadded with grouped key/value heads kept (as on the CPU;
    a candidate for CUDA, where unpadded attention repeats them today); model FLOPs (as in
    bench_train) against the measured bf16 peak of an 8192^3 matmul on this GPU.
Prints a markdown section and writes it through the harness's results writer (and to `--out`).
`--smoke` runs the same code on the CPU at tiny sizes (no GPU needed; no figure).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from benchmarks import harness
from benchmarks.bench_engine import Row, engine_measure, interleaved, make_prompts
from benchmarks.bench_train import agent_batch, param_counts, result, synthetic_batch, update_fn
from relayrl.engine.local import LocalEngine
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.train import attention
from relayrl.train.actor import Actor
from relayrl.train.config import TrainConfig

NAME = "gpu"

LEVELS = (1, 8, 32)
DEVICE = "cuda"
"""`--device cpu` runs the same code on the CPU (to check the script, not to report)."""


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for on the CPU)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_timed(fn: Callable[[], object]) -> float:
    """Seconds of `fn` with the GPU's queue drained before and after."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def matmul_peak_tflops(n: int = 8192, repeats: int = 10) -> float:
    """Mean TFLOP/s of an n^3 bf16 matmul on random data, after three warm-ups."""
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    seconds = cuda_timed(lambda: [a @ b for _ in range(repeats)]) / repeats
    return 2 * n**3 / seconds / 1e12


def hf_measure(model, pad: int, prompts: list[list[int]], new: int, c: int) -> Callable[[], Row]:
    """transformers `generate`, greedy, bf16: c = 1 one request at a time (two), else a batch."""
    batches = [prompts[:c]] if c > 1 else [[p] for p in prompts[:2]]
    tensors = []
    for batch in batches:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=DEVICE)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=DEVICE)
        tensors.append((ids, mask))
    gen = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": pad}

    def measure() -> Row:
        tokens, seconds = 0, 0.0
        for ids, mask in tensors:
            with torch.inference_mode():
                start = time.perf_counter()
                out = model.generate(input_ids=ids, attention_mask=mask, **gen)
                sync()
                seconds += time.perf_counter() - start
            tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        return Row("HF generate (bf16)", c, tokens, seconds)

    with torch.inference_mode():
        model.generate(input_ids=tensors[0][0], attention_mask=tensors[0][1], max_new_tokens=4,
                       do_sample=False, pad_token_id=pad)
    return measure


def engine_rows(path: str, new: int, repeats: int,
                levels: tuple[int, ...] = LEVELS) -> list[Row]:
    """LocalEngine and transformers, interleaved, at each concurrency level."""
    engine = LocalEngine(path, device=DEVICE, max_batch_size=max(levels))
    try:
        if DEVICE == "cuda":
            assert engine.dtype == torch.bfloat16, engine.dtype
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
        tok = engine.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        prompts = make_prompts(tok, max(levels))
        measures = []
        for c in levels:
            measures += [engine_measure(engine, prompts, new, c),
                         hf_measure(model, pad, prompts, new, c)]
        with tqdm(total=len(measures) * repeats, desc="engine", unit="run") as bar:
            return interleaved(measures, repeats, bar)
    finally:
        engine.close()


@contextlib.contextmanager
def grouped_heads_kept(keep: bool) -> Iterator[None]:
    """Within it (`keep`), unpadded attention hands SDPA grouped key/value heads as they are,
    as it does on the CPU, instead of repeating them for CUDA's masked kernels. Only for rows
    without a shared prefix: there is no mask then, and CUDA's flash kernel takes `enable_gqa`."""
    if not keep:
        yield
        return
    real = attention._masks_grouped_heads
    attention._masks_grouped_heads = lambda device: True
    try:
        yield
    finally:
        attention._masks_grouped_heads = real


def update_rows(path: str, repeats: int,
                rows: int = 16) -> list[tuple[str, str, float, float, float]]:
    """(batch, packing, seconds, real tokens/s, model TFLOP/s) of the default update on the GPU,
    each batch unpadded (the default) and padded, the cases interleaved in every round; rows
    without a shared prefix also unpadded with their grouped key/value heads kept (a candidate
    for the CUDA path, not what it does today)."""
    cfg = TrainConfig(micro_batch_tokens=4096)
    actor = Actor(path, cfg, device=DEVICE)
    body, head = param_counts(actor.model)
    vocab = actor.model.config.vocab_size
    plain, agent = synthetic_batch(rows, vocab), agent_batch(rows, vocab)
    cases = [(f"{rows} rows x 394-472 tokens", plain, replace(cfg, share_prefix=False), "unpad", False),
             (f"{rows} rows x 394-472 tokens", plain, replace(cfg, share_prefix=False, packing="pad"),
              "pad", False),
             (f"{rows} rows x 394-472 tokens", plain, replace(cfg, share_prefix=False),
              "unpad, KV heads kept grouped", True),
             (f"{rows} agent rows, shared prefix", agent, cfg, "unpad", False),
             (f"{rows} agent rows, shared prefix", agent, replace(cfg, packing="pad"), "pad", False)]
    fns = []
    for _, batch, case_cfg, _, keep in cases:
        actor.config = case_cfg
        fns.append(update_fn(actor, batch, case_cfg))
        with grouped_heads_kept(keep):
            fns[-1]()  # warm-up: cuBLAS handles, the allocator's pools
    best = [float("inf")] * len(cases)
    metrics: list[dict[str, float]] = [{} for _ in cases]
    for _ in tqdm(range(repeats), desc="update", unit="round"):
        for i, ((_, _, case_cfg, _, keep), fn) in enumerate(zip(cases, fns, strict=True)):
            actor.config = case_cfg
            with grouped_heads_kept(keep):
                elapsed = cuda_timed(lambda fn=fn, i=i: metrics.__setitem__(i, fn()))
            best[i] = min(best[i], elapsed)
    out = []
    for (name, batch, _, label, _), seconds, m in zip(cases, best, metrics, strict=True):
        r = result(name, batch, seconds, m, body, head)
        out.append((name, label, seconds, r.tok_s, r.flops / seconds / 1e12))
    return out


def render(meta: dict[str, str], rows: list[Row],
           updates: list[tuple[str, str, float, float, float]], peak: float) -> str:
    """The markdown section."""
    hf = {r.concurrency: r for r in rows if r.name.startswith("HF")}
    lines = ["## On a GPU", "", f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}  ",
             f"Date: {meta['date']}", "",
             f"LocalEngine vs transformers `generate` on the same GPU, {meta['new']} new tokens "
             f"per request, greedy, no stop ids; best of {meta['repeats']} interleaved rounds.", "",
             "| what | concurrent | tokens/s | vs HF generate | TTFT p50 |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = r.tok_s / hf[r.concurrency].tok_s
        ttft = f"{r.ttft_p50_s * 1000:.0f} ms" if r.ttft_p50_s is not None else ""
        lines.append(f"| {r.name} | {r.concurrency} | {r.tok_s:.0f} | {ratio:.2f}x | {ttft} |")
    lines += ["", f"`Actor.update` (bf16 copy, fp32 masters) on the GPU; bf16 matmul peak "
              f"measured {peak:.1f} TFLOP/s (a large square matmul).", "",
              "| batch | packing | seconds | tokens/s | model TFLOP/s | share of peak |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name, packing, seconds, tok_s, tflops in updates:
        lines.append(f"| {name} | {packing} | {seconds:.3f} | {tok_s:.0f} | {tflops:.1f} | "
                     f"{tflops / peak:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Measure and print the section."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the section to this file")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    levels, rows = LEVELS, 16
    if args.smoke:  # the same code on the CPU: checks the script, measures nothing
        args.device, args.model, args.new_tokens, args.repeats = "cpu", harness.smoke_model(), 4, 1
        levels, rows = (1, 2), 4
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("the gpu benchmark needs a CUDA GPU (--smoke runs its code on the CPU)")
    run = harness.Run.start(NAME, args, argv)
    path = model_path(args.model)
    peak = matmul_peak_tflops(8192 if DEVICE == "cuda" else (256 if args.smoke else 1024))
    engine = engine_rows(path, args.new_tokens, args.repeats, levels)
    updates = update_rows(path, args.repeats, rows)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "no GPU (CPU)"
    meta = {"command": run.command, "date": run.started,
            "machine": f"{gpu}; host {harness.machine().describe()}",
            "new": str(args.new_tokens), "repeats": str(args.repeats)}
    text = render(meta, engine, updates, peak)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    run.finish(text, {"engine": [{"name": r.name, "concurrent": r.concurrency, "tok_s": r.tok_s}
                                 for r in engine],
                      "updates": [{"batch": u[0], "packing": u[1], "seconds": u[2]}
                                  for u in updates], "peak_tflops": peak})


if __name__ == "__main__":
    main()
