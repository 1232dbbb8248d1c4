"""`python -m benchmarks NAME [args]` runs one benchmark; `python -m benchmarks list` names them."""

from __future__ import annotations

import sys

from benchmarks.registry import BENCHMARKS, get, listing


def main(argv: list[str]) -> int:
    """Dispatch to the benchmark named first in `argv`."""
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("usage: python -m benchmarks NAME [args]   (python -m benchmarks NAME --help)\n")
        print(listing())
        return 0
    try:
        bench = get(argv[0])
    except KeyError:
        names = ", ".join(b.name for b in BENCHMARKS)
        print(f"no benchmark named {argv[0]!r}; there are: {names}", file=sys.stderr)
        return 2
    bench.load().main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
