"""Benchmarks (not tests): offline throughput against transformers, workloads."""
