"""One-off experiments that start a real local cluster and compare it with the replay simulator.

Not part of `make test`: each experiment takes minutes and its numbers go into docs/benchmarks.md.
"""
