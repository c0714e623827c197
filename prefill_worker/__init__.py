"""Prefill workers: batch prompts, reuse the local prefix cache, push KV layer by layer."""
