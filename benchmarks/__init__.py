"""relayrl's benchmark suite: `python -m benchmarks list`, `python -m benchmarks NAME [args]`.

Each benchmark is a module with `main(argv)`, named in `benchmarks.registry.BENCHMARKS`, and runs
on `benchmarks.harness` (machine and ISA, load, interleaved rounds, the results writer).
"""
