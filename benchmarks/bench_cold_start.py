"""Cold start: from launching a server to its first recorded answer, and its memory then.

Run by hand, under the shared benchmark lock (AReaL's venv from `scripts/install_areal.sh` is
optional):

    flock /tmp/relayrl-bench.lock python -m benchmarks cold-start [--rounds 3]

What a user waits for after typing the command: each server is started as a fresh process, and
the clock runs from the launch until a chat completion inside a session has been answered (the
session opened first, as an agent's first call would be), polling every 20 ms while the port is
not yet open. Then the process's resident memory (VmRSS) and its peak (VmHWM) are read from
/proc, and it is stopped. Servers, each on loopback:
  - `relayrl gateway --engine fake`: the CLI a user runs, with the scripted engine (no model
    weights): the gateway's own start-up, the tokenizer included;
  - `relayrl gateway --engine local`: the same with the default model in process (weights
    loaded, the engine started): what serving the real policy costs to start;
  - AReaL 1.0.4's proxy rollout server over a mock engine and the same tokenizer (exactly as
    vs-areal serves it), when AReaL's venv is there.
Rounds are interleaved (the servers' order alternates); the table shows each round and the
median. The packaged model is provisioned before the first round, so no round converts it.
`--smoke` runs one round, the local-engine gateway on the smoke runs' stand-in model.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import bench_vs_areal as b
from benchmarks import harness
from relayrl.models import DEFAULT_MODEL, model_path

NAME = "cold-start"
ADMIN = b.ADMIN
POLL_S = 0.02
TIMEOUT_S = 180.0


@dataclass
class Launch:
    """How to start one server and reach it."""

    name: str
    argv: Callable[[int, str], list[str]]  # (port, port file) -> command line
    env: dict[str, str]
    chat_path: str
    grant_capacity: bool  # AReaL: a session needs a capacity grant first
    port_from_file: bool  # AReaL's child picks its own port and writes it to the port file


def post(port: int, path: str, key: str, payload: dict) -> dict:
    """POST JSON to loopback; the decoded answer (any status but 200 raises)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(payload),
                     headers={"Authorization": f"Bearer {key}",
                              "Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{path}: {resp.status} {raw[:200]!r}")
    return json.loads(raw)


def first_answer(port: int, launch: Launch) -> None:
    """Open a session and make one chat call in it."""
    if launch.grant_capacity:
        post(port, "/grant_capacity", ADMIN, {})
    key = post(port, "/rl/start_session", ADMIN, {"task_id": "cold-start"})["api_key"]
    body = json.loads(b.body(b.history(2)))
    reply = post(port, launch.chat_path, key, body)
    if not reply["choices"][0]["message"]["content"]:
        raise RuntimeError(f"{launch.name}: empty answer")


def memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of `pid` in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)


def measure(launch: Launch) -> dict[str, float]:
    """Launch the server, time its first recorded answer, read its memory, stop it."""
    port_file = tempfile.mktemp()
    port = 0 if launch.port_from_file else harness.free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(launch.argv(port, port_file), env=launch.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = t0 + TIMEOUT_S
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"{launch.name} exited with {proc.returncode}: {err[-800:]}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{launch.name}: no answer within {TIMEOUT_S:.0f} s")
            if launch.port_from_file and not port:
                text = Path(port_file).read_text() if os.path.exists(port_file) else ""
                port = int(text.rsplit(":", 1)[1]) if text else 0
            if port:
                try:
                    first_answer(port, launch)
                    break
                except ConnectionError:  # refused or reset: not listening yet
                    pass
            time.sleep(POLL_S)
        seconds = time.perf_counter() - t0
        rss, peak = memory_mb(proc.pid)
        return {"s": seconds, "rss": rss, "peak": peak}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if os.path.exists(port_file):
            os.unlink(port_file)


def launches(model_dir: str, with_areal: bool, local_model: str = DEFAULT_MODEL) -> list[Launch]:
    """The servers to measure (AReaL's only where its venv is there)."""
    cli = Path(sys.executable).parent / "relayrl"
    relayrl = [str(cli)] if cli.exists() else [sys.executable, "-m", "relayrl.cli"]

    def gateway(engine: str, model: str = DEFAULT_MODEL) -> Callable[[int, str], list[str]]:
        return lambda port, _file: [*relayrl, "gateway", "--engine", engine, "--model",
                                    model, "--port", str(port), "--admin-key", ADMIN]

    which = "the default model" if local_model == DEFAULT_MODEL else Path(local_model).name
    out = [Launch("relayrl gateway --engine fake", gateway("fake"), dict(os.environ),
                  "/v1/chat/completions", False, False),
           Launch(f"relayrl gateway --engine local ({which})", gateway("local", local_model),
                  dict(os.environ), "/v1/chat/completions", False, False)]
    venv = b.areal_venv() if with_areal else None
    if venv is not None:
        env = {**os.environ, "AREAL_PROXY_WARN_ONCE": "1", "PYTHONPATH": str(harness.ROOT),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        python = str(venv / "bin" / "python")
        out.append(Launch("AReaL 1.0.4 proxy (mock engine)",
                          lambda _port, file: harness.child_command(
                              b.NAME, "--serve-areal", model_dir, file, python=python),
                          env, "/chat/completions", True, True))
    elif with_areal:
        print("AReaL's venv is missing (scripts/install_areal.sh makes it): relayrl alone",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the interleaved rounds and print the table."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--relayrl-only", action="store_true", help="do not start AReaL")
    args = ap.parse_args(argv)
    local_model = DEFAULT_MODEL
    if args.smoke:
        args.rounds, local_model = 1, harness.smoke_model()
    run = harness.Run.start(NAME, args, argv)
    model_dir = str(model_path(DEFAULT_MODEL))  # provisioned here, outside every timed round
    servers = launches(model_dir, not args.relayrl_only, local_model)
    print(f"date {harness.utc_now()}; load average at the start {run.load_before:.2f}",
          flush=True)
    got: dict[str, list[dict[str, float]]] = {s.name: [] for s in servers}
    for r, s in harness.rounds(servers, args.rounds):
        got[s.name].append(measure(s))
        print(f"round {r + 1}: {s.name}: {got[s.name][-1]['s']:.2f} s", flush=True)
    run.say(f"load average at the end {harness.load_average():.2f}")
    run.say("")
    run.say("| server | launch to first answer, s (median; each round) | RSS then, MB | "
            "peak RSS, MB |")
    run.say("| --- | --- | ---: | ---: |")
    for s in servers:
        xs = got[s.name]
        secs = ", ".join(f"{x['s']:.2f}" for x in xs)
        run.say(f"| {s.name} | **{statistics.median(x['s'] for x in xs):.2f}** ({secs}) | "
                f"{statistics.median(x['rss'] for x in xs):.0f} | "
                f"{statistics.median(x['peak'] for x in xs):.0f} |")
    run.finish(metrics=got)


if __name__ == "__main__":
    main()
