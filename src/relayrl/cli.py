"""The `relayrl` command: models, gateway (and, later, train and chat).

Subcommands import what they need when they run, so `relayrl --help` and `relayrl gateway` start
without torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from relayrl.errors import RelayError


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


def _cmd_gateway(args: argparse.Namespace) -> int:
    from relayrl.gateway.server import GatewayConfig, serve

    config = GatewayConfig(
        model=args.model,
        engine=args.engine,
        host=args.host,
        port=args.port,
        admin_key=args.admin_key,
        log_path=args.log,
        session_ttl_s=args.session_ttl,
        ended_ttl_s=args.ended_ttl,
    )
    serve(config)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from relayrl.launch.run import run_from_config

    result = run_from_config(args.config, args.overrides)
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
                        admin_key=args.admin_key, model_label=label, max_staleness=None))
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    import asyncio

    from relayrl.launch.inference import answer, find_checkpoint

    checkpoint = args.checkpoint or find_checkpoint(args.fileroot, args.experiment, args.trial,
                                                    args.step)
    print(asyncio.run(answer(str(checkpoint), args.prompt, max_tokens=args.max_tokens,
                             system=args.system)))
    return 0


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
    gw.add_argument("--engine", choices=["local", "fake"], default="local")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument("--admin-key", default=None, help="key for admin routes (required off loopback)")
    gw.add_argument("--log", default=None, help="SQLite log of every call (recovered on restart)")
    gw.add_argument("--session-ttl", type=float, default=3600.0, help="idle seconds before a session is aborted")
    gw.add_argument("--ended-ttl", type=float, default=6 * 3600.0,
                    help="idle seconds before an ended session nobody exported is aborted")
    gw.set_defaults(func=_cmd_gateway)

    tr = sub.add_parser("train", help="train an agent with RL (config YAML + dotted overrides)")
    tr.add_argument("config", help="YAML config, e.g. examples/math_agent/config.yaml")
    tr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-5")
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
