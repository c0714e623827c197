"""Decode workers: a tensor-parallel group that reserves KV blocks, receives prompt KV from
prefill workers and generates with continuous batching."""
