"""Benchmarks (GPU) and the op self-check (any machine)."""
