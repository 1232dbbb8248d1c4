"""`relayrl router`: its flags, and `main(argv)` for the `relayrl` command to call.

May import: relayrl.router, relayrl.errors.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence

from relayrl.errors import RelayError


def build_parser() -> argparse.ArgumentParser:
    """The flags of `relayrl router`."""
    p = argparse.ArgumentParser(
        prog="relayrl router",
        description="One public URL in front of several relayrl gateways: sessions go to the "
        "least-loaded healthy gateway and stay there; completions are relayed byte for byte.")
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a gateway's root URL (repeat for each)")
    p.add_argument("--tenants", default=None, metavar="FILE",
                   help="YAML/JSON: per tenant, name, api_key_sha256 and its own backends")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between checks")
    p.add_argument("--hash-key", action="store_true",
                   help="print the sha256 of a key read from stdin (for a tenants file) and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run `relayrl router` with `argv` (the arguments after `router`)."""
    args = build_parser().parse_args(argv)
    if args.hash_key:
        key = sys.stdin.readline().strip()
        if not key:
            print("relayrl router --hash-key: give the key on stdin", file=sys.stderr)
            return 2
        print(hashlib.sha256(key.encode()).hexdigest())
        return 0
    from relayrl.router.config import RouterConfig, load_tenants
    from relayrl.router.server import serve

    try:
        tenants = load_tenants(args.tenants) if args.tenants else []
        config = RouterConfig(backends=[b.rstrip("/") for b in args.backend], tenants=tenants,
                              host=args.host, port=args.port,
                              health_interval_s=args.health_interval)
        config.validate()
        serve(config)
    except RelayError as e:
        print(f"relayrl router: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
