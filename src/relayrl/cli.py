"""The `relayrl` command: models, gateway (and, later, train and chat).

Subcommands import what they need when they run, so `relayrl --help` and `relayrl gateway` start
without torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from relayrl.errors import ConfigError, RelayError


def _cmd_models(args: argparse.Namespace) -> int:
    from relayrl.models import DEFAULT_MODEL, PACKAGED_MODELS, is_provisioned, model_path

    if args.action == "path":
        if not args.name:
            print("usage: relayrl models path NAME", file=sys.stderr)
            return 2
        print(model_path(args.name))
        return 0
    for m in PACKAGED_MODELS.values():
        flags = " (default)" if m.name == DEFAULT_MODEL else ""
        state = "provisioned" if is_provisioned(m) else "not provisioned"
        print(f"{m.name}{flags}\t{state}\t{m.description}\tpip: {' '.join(m.pip_names)}")
    return 0


def _role_models(pairs: list[str] | None) -> dict[str, str]:
    """`--role-model NAME=ROLE` pairs as a mapping (an argparse error for a malformed one)."""
    out: dict[str, str] = {}
    for pair in pairs or ():
        name, sep, role = pair.partition("=")
        if not sep or not name or not role:
            raise SystemExit(f"relayrl gateway: --role-model takes NAME=ROLE, got {pair!r}")
        out[name] = role
    return out


def _cmd_gateway(args: argparse.Namespace) -> int:
    from relayrl.gateway.server import GatewayConfig, serve

    config = GatewayConfig(
        model=args.model,
        engine=args.engine,
        engine_url=args.engine_url,
        host=args.host,
        port=args.port,
        admin_key=args.admin_key,
        log_path=args.log,
        session_ttl_s=args.session_ttl,
        max_staleness=args.max_staleness,
        batch_size=args.batch_size,
        ended_ttl_s=args.ended_ttl,
        replicas=args.replicas,
        roles=args.roles or bool(args.role_model),
        role_models=_role_models(args.role_model),
    )
    if config.replicas > 1:
        from relayrl.launch.replicas import serve_replicas

        serve_replicas(config)
        return 0
    serve(config)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from relayrl.launch.run import run_from_config

    config, overrides = args.config, list(args.overrides)
    if args.config_option is not None:  # `relayrl train --config CFG [overrides]`
        if config is not None and "=" not in config:
            raise ConfigError(f"two configs given: {config} and --config "
                              f"{args.config_option}; name one")
        config, overrides = args.config_option, [c for c in [config] if c] + overrides
    if config is None:
        raise ConfigError("name a config: relayrl train CONFIG [key=value ...] (or --config "
                          "CONFIG)")
    result = run_from_config(config, overrides)
    print(result.summary(), flush=True)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from relayrl.service.run import serve_from_config

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config, *overrides]  # `relayrl serve gateway.port=9000`
    result = serve_from_config(config, overrides)
    print(result.summary(), flush=True)
    return 0


def _cmd_serve_model(args: argparse.Namespace) -> int:
    from relayrl.gateway.server import GatewayConfig, serve
    from relayrl.launch.inference import find_checkpoint

    checkpoint = args.checkpoint or find_checkpoint(args.fileroot, args.experiment, args.trial,
                                                    args.step)
    label = (f"{args.experiment}/{args.trial}" if args.experiment and args.trial
             else str(checkpoint))
    serve(GatewayConfig(model=str(checkpoint), engine="local", host=args.host, port=args.port,
                        admin_key=args.admin_key, model_label=label, max_staleness=None),
          control=args.admin_key is not None)
    return 0


def _cmd_engine(args: argparse.Namespace) -> int:
    import signal

    from relayrl.engine.vllm_server import start_vllm_server
    from relayrl.models import model_path

    server = start_vllm_server(model_path(args.model), port=args.port, venv=args.venv,
                               host=args.host)
    print(f"relayrl engine vllm listening at {server.url} (ready after {server.startup_s:.0f} s)",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        return int(server.process.wait() or 0)
    finally:
        server.stop()


def _cmd_rollout_server(args: argparse.Namespace) -> int:
    from relayrl.remote_rollout.cli import main as rollout_server_main

    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    return int(rollout_server_main(rest))


def _cmd_router(args: argparse.Namespace) -> int:
    from relayrl.router.cli import main as router_main

    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    return int(router_main(rest))


def _cmd_view(args: argparse.Namespace) -> int:
    from relayrl.viewer import main as view_main

    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    return int(view_main(rest))


def _cmd_export(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from relayrl import __version__
    from relayrl.trajectory.atif import session_to_atif
    from relayrl.trajectory.export import export_session
    from relayrl.trajectory.interchange import write_jsonl, write_parquet
    from relayrl.trajectory.store import InteractionLog

    if not Path(args.log).is_file():
        print(f"relayrl export: no durable log at {args.log}", file=sys.stderr)
        return 2
    with InteractionLog(args.log) as log:
        sessions = [s for s in log.recover(include_closed=True)
                    if s.interactions and (not args.session or s.id in args.session)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.format == "atif":
        for s in sessions:
            traj = session_to_atif(s, agent_name=args.agent_name, agent_version=__version__,
                                   model_name=args.model_name)
            (out / f"{s.id}.json").write_text(json.dumps(traj, ensure_ascii=False))
        print(f"wrote {len(sessions)} ATIF trajectories to {out}")
        return 0
    # aborted sessions are never training data; the ATIF export above keeps them (state in extra)
    rows = [r for s in sessions if str(s.state) != "aborted"
            for r in export_session(s, style=args.style)]
    writer = write_jsonl if args.format == "jsonl" else write_parquet
    n = writer(rows, out / f"trajectories.{args.format}")
    print(f"wrote {n} rows of {len(sessions)} sessions to {out}")
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    import asyncio

    from relayrl.launch.inference import answer, find_checkpoint

    checkpoint = args.checkpoint or find_checkpoint(args.fileroot, args.experiment, args.trial,
                                                    args.step)
    print(asyncio.run(answer(str(checkpoint), args.prompt, max_tokens=args.max_tokens,
                             system=args.system)))
    return 0


def _config_flag_first(args: list[str]) -> list[str]:
    """`args` with `--config X` moved to the front: overrides may come before or after it."""
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            return [arg, args[i + 1], *args[:i], *args[i + 2:]]
        if arg.startswith("--config="):
            return [arg, *args[:i], *args[i + 1:]]
    return args


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `relayrl` command."""
    parser = argparse.ArgumentParser(prog="relayrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="list packaged models, or print a model's local directory")
    models.add_argument("action", nargs="?", choices=["list", "path"], default="list")
    models.add_argument("name", nargs="?", help="packaged name, local HF directory or hub id")
    models.set_defaults(func=_cmd_models)

    gw = sub.add_parser("gateway", help="serve the policy over OpenAI/Anthropic APIs and record every call")
    gw.add_argument("--model", default="smollm2-135m-instruct", help="packaged name, HF dir or hub id")
    gw.add_argument("--engine", choices=["local", "fake", "vllm", "sglang"], default="local",
                    help="local: the model in this process; vllm/sglang: a server at --engine-url")
    gw.add_argument("--engine-url", default=None, help="root URL of a vLLM or SGLang server")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument("--admin-key", default=None, help="key for admin routes (required off loopback)")
    gw.add_argument("--log", default=None, help="SQLite log of every call (recovered on restart)")
    gw.add_argument("--session-ttl", type=float, default=3600.0, help="idle seconds before a session is aborted")
    gw.add_argument("--max-staleness", type=int, default=None,
                    help="staleness rule for an external trainer: admit sessions while submitted "
                    "<= (version + N + 1) x batch size; version from POST /rl/v1/set_version "
                    "(default: no rule)")
    gw.add_argument("--batch-size", type=int, default=8,
                    help="sessions per training batch, for --max-staleness")
    gw.add_argument("--ended-ttl", type=float, default=6 * 3600.0,
                    help="idle seconds before an ended session nobody exported is aborted")
    gw.add_argument("--replicas", type=int, default=1,
                    help="N gateway + engine pairs behind one router; --host/--port are then "
                    "the router's (the one public URL)")
    gw.add_argument("--roles", action="store_true",
                    help="record a role per call: the x-relayrl-role header, a child session's "
                    "URL, the model name (policy@role), the session's metadata role "
                    "(docs/multi-agent.md)")
    gw.add_argument("--role-model", action="append", metavar="NAME=ROLE",
                    help="calls naming model NAME are recorded under ROLE (repeatable; "
                    "implies --roles)")
    gw.set_defaults(func=_cmd_gateway)

    tr = sub.add_parser("train", help="train an agent with RL (config YAML + dotted overrides)")
    tr.add_argument("config", nargs="?", default=None,
                    help="YAML config, e.g. examples/math_agent/config.yaml")
    tr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-5")
    tr.add_argument("--config", dest="config_option", default=None, metavar="CONFIG",
                    help="the YAML config, as a flag (the same as the positional CONFIG)")
    tr.set_defaults(func=_cmd_train)

    sv = sub.add_parser("serve", help="the any-agent RL service: agents anywhere drive sessions, "
                        "the trainer learns from what they finalize")
    sv.add_argument("config", nargs="?", default=None, help="YAML config (same format as train)")
    sv.add_argument("overrides", nargs="*", help="dotted overrides, e.g. gateway.port=8080")
    sv.set_defaults(func=_cmd_serve)

    sm = sub.add_parser("serve-model", help="serve a trained checkpoint for inference "
                        "(OpenAI and Anthropic APIs, calls not recorded)")
    sm.add_argument("--checkpoint", default=None, help="a checkpoint (HF) directory")
    sm.add_argument("--experiment", default=None)
    sm.add_argument("--trial", default=None)
    sm.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    sm.add_argument("--fileroot", default="runs")
    sm.add_argument("--host", default="127.0.0.1")
    sm.add_argument("--port", type=int, default=8000)
    sm.add_argument("--admin-key", default=None, help="required off loopback")
    sm.set_defaults(func=_cmd_serve_model)

    en = sub.add_parser("engine", help="start a managed inference server (vLLM, from the venv "
                        "scripts/install_vllm.sh makes) and wait until it is healthy")
    en.add_argument("kind", choices=["vllm"])
    en.add_argument("--model", default="smollm2-135m-instruct", help="packaged name, HF dir or hub id")
    en.add_argument("--host", default="127.0.0.1")
    en.add_argument("--port", type=int, default=None, help="default: a free port")
    en.add_argument("--venv", default=None, help="vLLM's venv (default: .venv-vllm or $RELAYRL_VLLM_VENV)")
    en.set_defaults(func=_cmd_engine)

    rs = sub.add_parser("rollout-server", add_help=False,
                        help="the reference server of the remote rollout protocol: POST /rollout, "
                        "GET /tools (an API key off loopback); `relayrl rollout-server --help` "
                        "lists its flags")
    rs.add_argument("args", nargs=argparse.REMAINDER)
    rs.set_defaults(func=_cmd_rollout_server)

    rt = sub.add_parser("router", add_help=False,
                        help="one URL in front of several gateways (session-affine; --tenants "
                        "FILE); `relayrl router --help` lists its flags")
    rt.add_argument("args", nargs=argparse.REMAINDER)
    rt.set_defaults(func=_cmd_router)

    vw = sub.add_parser("view", add_help=False,
                        help="watch a finished run's episodes in a browser (a live gateway "
                        "serves the same page at /view); `relayrl view --help` lists its flags")
    vw.add_argument("args", nargs=argparse.REMAINDER)
    vw.set_defaults(func=_cmd_view)

    ex = sub.add_parser("export", help="write recorded sessions from a gateway's durable log "
                                       "(--log) as ATIF trajectories or training rows")
    ex.add_argument("log", help="the SQLite durable log a gateway wrote (`relayrl gateway --log`)")
    ex.add_argument("--format", choices=("atif", "jsonl", "parquet"), default="atif",
                    help="atif: one ATIF v1.8 trajectory per session, tokens included; "
                         "jsonl/parquet: relayrl's training rows")
    ex.add_argument("--out", default="export", help="output directory")
    ex.add_argument("--session", action="append", default=None,
                    help="export only this session id (repeatable; default: all with calls)")
    ex.add_argument("--style", default="concat", choices=("concat", "individual"),
                    help="row style for jsonl/parquet")
    ex.add_argument("--agent-name", default="relayrl-agent", help="ATIF agent.name")
    ex.add_argument("--model-name", default=None, help="ATIF agent.model_name")
    ex.set_defaults(func=_cmd_export)

    ch = sub.add_parser("chat", help="answer a prompt with a trained checkpoint")
    ch.add_argument("prompt")
    ch.add_argument("--checkpoint", default=None, help="a checkpoint (HF) directory")
    ch.add_argument("--experiment", default=None)
    ch.add_argument("--trial", default=None)
    ch.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ch.add_argument("--fileroot", default="runs")
    ch.add_argument("--system", default=None, help="system message")
    ch.add_argument("--max-tokens", type=int, default=256)
    ch.set_defaults(func=_cmd_chat)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `relayrl` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["rollout-server"], ["router"], ["view"]):  # own parsers: flags pass through
        argv = [argv[0], "--", *argv[1:]]
    if argv[:1] == ["train"]:
        argv = ["train", *_config_flag_first(argv[1:])]
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RelayError as e:
        print(f"relayrl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
