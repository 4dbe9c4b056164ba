"""The benchmarks as one tool: ``python -m benchmarks list`` names them, ``python -m benchmarks NAME ARGS``
runs one (benchmarks/registry.py lists them; BENCHMARKS.md quotes their numbers). Kept free of imports so
that listing the benchmarks loads none of them."""
