"""Shared parts of the GPU benchmarks (the GPU host only; see ``tests/gpu/README.md``)."""
