"""`relayrl rollout-server`: run the reference rollout server (calculator agent) with uvicorn.

Flags override the environment (ROLLOUT_SERVER_PORT, HTTP_CLIENT_TIMEOUT,
TOKENIZER_TRUST_REMOTE_CODE, TOKENIZER_CACHE_SIZE, MAX_CONCURRENT_ROLLOUTS, ...), which overrides
the defaults. Off loopback the server refuses to start without an API key
(ROLLOUT_SERVER_API_KEY or --api-key-file). Imports this package, argparse, relayrl.asgi and
uvicorn only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from relayrl.remote_rollout.config import ServerConfig, is_loopback


def build_parser(prog: str = "relayrl rollout-server") -> argparse.ArgumentParser:
    """The command's flags (every one defaults to the environment's value)."""
    p = argparse.ArgumentParser(prog=prog, description="Serve the remote rollout protocol "
                                "(GET /tools, POST /rollout, GET /health) with the calculator agent.")
    p.add_argument("--host", help="bind address (ROLLOUT_SERVER_HOST, default 127.0.0.1); any "
                   "other than loopback needs an API key")
    p.add_argument("--port", type=int, help="port (ROLLOUT_SERVER_PORT, default 9000)")
    p.add_argument("--http-client-timeout", type=float,
                   help="seconds per trainer callback (HTTP_CLIENT_TIMEOUT, default 300)")
    trc = p.add_mutually_exclusive_group()
    trc.add_argument("--tokenizer-trust-remote-code", dest="trust", action="store_true",
                     default=None, help="let the transformers backend run a tokenizer's own "
                     "code (TOKENIZER_TRUST_REMOTE_CODE, default false)")
    trc.add_argument("--no-tokenizer-trust-remote-code", dest="trust", action="store_false")
    p.add_argument("--tokenizer-cache-size", type=int, help="TOKENIZER_CACHE_SIZE (default 5)")
    p.add_argument("--tokenizer-backend", choices=("relayrl", "transformers"),
                   help="TOKENIZER_BACKEND (default relayrl: torch-free)")
    p.add_argument("--tokenizer", help="default tokenizer: a packaged model name or a local "
                   "HF folder (ROLLOUT_TOKENIZER, default smollm2-135m-instruct)")
    p.add_argument("--max-concurrent-rollouts", type=int, help="MAX_CONCURRENT_ROLLOUTS (100)")
    p.add_argument("--tool-delay-ms", type=float, nargs=2, metavar=("MIN", "MAX"),
                   help="random delay per tool call (default 10 100; 0 0 turns it off)")
    p.add_argument("--tool-seed", type=int, help="seed of the tool delays (TOOL_SEED)")
    p.add_argument("--api-key-file", help="file holding the API key that /rollout and /tools "
                   "require (or ROLLOUT_SERVER_API_KEY); needed to bind off loopback")
    p.add_argument("--allow-callback-host", action="append", metavar="HOST",
                   help="a host (name, IP address or network like 10.0.0.0/8) a request's "
                   "server_url may name, besides loopback; repeatable "
                   "(ROLLOUT_ALLOWED_CALLBACK_HOSTS, comma-separated)")
    p.add_argument("--allow-tokenizer", action="append", metavar="NAME",
                   help="a tokenizer a request's tokenizer_name may name, besides --tokenizer; "
                   "repeatable (ROLLOUT_ALLOWED_TOKENIZERS, comma-separated)")
    return p


def _read_key(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ValueError(f"--api-key-file {path}: {e.strerror}") from None
    if not key:
        raise ValueError(f"--api-key-file {path} is empty")
    return key


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The environment's settings with the given flags on top."""
    delay = args.tool_delay_ms
    return ServerConfig.from_env(
        host=args.host, port=args.port, http_client_timeout=args.http_client_timeout,
        tokenizer_trust_remote_code=args.trust, tokenizer_cache_size=args.tokenizer_cache_size,
        tokenizer_backend=args.tokenizer_backend, default_tokenizer=args.tokenizer,
        max_concurrent_rollouts=args.max_concurrent_rollouts, tool_seed=args.tool_seed,
        tool_delay_min_s=None if delay is None else delay[0] / 1000,
        tool_delay_max_s=None if delay is None else delay[1] / 1000,
        api_key=_read_key(args.api_key_file),
        allowed_callback_hosts=(None if args.allow_callback_host is None
                                else tuple(args.allow_callback_host)),
        allowed_tokenizers=None if args.allow_tokenizer is None else tuple(args.allow_tokenizer))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, then serve until interrupted; returns the exit code."""
    import uvicorn

    from relayrl.asgi import uvicorn_options
    from relayrl.remote_rollout.server import create_app

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    if not is_loopback(config.host) and config.api_key is None:
        print(f"relayrl rollout-server: error: binding {config.host} (off loopback) needs an API "
              "key: set ROLLOUT_SERVER_API_KEY or pass --api-key-file", file=sys.stderr)
        return 2
    print(f"relayrl rollout server listening at http://{config.host}:{config.port} "
          f"(API key {'required' if config.api_key else 'off: loopback only'}; callbacks to "
          f"loopback{''.join(', ' + h for h in config.allowed_callback_hosts)})", flush=True)
    uvicorn.run(create_app(config=config), host=config.host, port=config.port,
                log_level="warning", access_log=False, **uvicorn_options())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
