"""A session turn on the decode worker that does not hold its prefix: pulled vs recomputed.

    python benchmarks/prefix_pull.py [--prefix 256 512 1024 1536] [--new 32] [--repeat 3]

The embedded default model (SmolLM2-135M, fp32) in three real workers in this process, KV over
real gloo on 127.0.0.1 with the cluster secret: a prefill worker P and decode workers A and B.
For each prefix length, a fresh random prompt of that many tokens runs as turn 1 on A (A
prefills it itself, so A caches it and P has never seen it: a session's history, made of its
prompts and A's own outputs), then turn 2 (the prefix plus `--new` tokens) goes to B, as when
A is full, two ways, each on its own fresh prompt:

    recompute  what pdserve did before pulls and what the router still does when a pull does
               not pay: B reserves, P prefills the whole prompt and pushes its KV to B
    pull       B reserves the prefix's blocks, A pushes them from its cache (PushPrefix's
               path: decode_worker.prefix_push), B prefills the new tokens itself

Timed from the first call to B until B has sampled turn 2's first token (TTFT on the worker
plane, no router), the median of `--repeat` fresh prompts per cell; the workers share this
process's torch threads (`--threads`), so the two modes compete for the same cores. Each
pulled turn's first token is checked, untimed, against the one P computes from its own KV of
the same prompt (greedy fp32). Run it alone: on a 2-core host anything else running skews
both columns.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pdserve.cluster_secret import ClusterSecret
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, load_model_config
from pdserve.engine.default_model import ensure_default_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.rendezvous import GlooConnector, GlooListener
from pdserve.prefill_worker.worker import PrefillWorker

SECRET = ClusterSecret(b"benchmark-prefix-pull-cluster-secret-0123")
FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
MODEL_NAME = "smollm2"
CALL_S = 300.0


def engine_config(model_dir, max_len: int, threads: int) -> EngineConfig:
    return EngineConfig(model=load_model_config(model_dir, max_model_len=max_len),
                        cache=CacheConfig(block_size=16, num_blocks=max_len // 16 * 8),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048),
                        num_threads=threads)


def decode_worker(config: EngineConfig) -> DecodeWorker:
    listener = GlooListener("127.0.0.1", secret=SECRET)
    return DecodeWorker(config, listener, [listener.endpoint], MODEL_NAME,
                        transport=GlooConnector(listener.endpoint, secret=SECRET))


def first_token(worker: DecodeWorker, request_id: str) -> int:
    """Wait for the request's first streamed token (its other news is drained too)."""
    end = time.monotonic() + CALL_S
    while time.monotonic() < end:
        for out in worker.next_outputs(timeout=0.01):
            if out.request_id == request_id:
                if out.finish_reason == "error":
                    raise RuntimeError(f"{request_id}: {out.error}")
                if out.token_ids:
                    return out.token_ids[0]
    raise TimeoutError(request_id)


def remote_prefill(prefill: PrefillWorker, decode: DecodeWorker, rid: str,
                   prompt: list[int]) -> int:
    descriptor = decode.reserve(rid, prompt, FIRST, [prefill.endpoint], time.time() + CALL_S)
    first = prefill.prefill(rid, prompt, FIRST, descriptor).result(CALL_S)
    decode.start(rid, first.first_token)
    return first_token(decode, rid)


def pulled(a: DecodeWorker, b: DecodeWorker, rid: str, prompt: list[int],
           num_pull: int) -> int:
    granted, descriptor = b.submit_pulling(rid, prompt, FIRST, [a.pusher.source], num_pull,
                                           time.time() + CALL_S)
    assert granted and descriptor is not None, "B should hold none of a fresh prefix"
    a.push_prefix(rid, prompt[:num_pull], None, descriptor)
    return first_token(b, rid)


def run(args: argparse.Namespace) -> None:
    model_dir = ensure_default_model()
    torch.set_num_threads(args.threads)
    max_len = max(args.prefix) + args.new + 16
    config = engine_config(model_dir, max_len, args.threads)
    prefill = PrefillWorker(config, GlooConnector(
        GlooListener("127.0.0.1", secret=SECRET).endpoint, secret=SECRET), MODEL_NAME)
    a, b = decode_worker(config), decode_worker(config)
    rng = random.Random(0)
    vocab = config.model.vocab_size
    try:
        print(f"{'prefix':>7} {'recompute s':>12} {'pull s':>8} {'ratio':>6}")
        for n in args.prefix:
            times: dict[str, list[float]] = {"recompute": [], "pull": []}
            for i in range(args.repeat + 1):  # the first round warms up
                for mode in ("recompute", "pull"):
                    prefix = [rng.randrange(100, vocab) for _ in range(n)]
                    rid = f"{mode}-{n}-{i}"
                    assert a.submit(rid + "-t1", prefix, FIRST)  # A caches it, P never saw it
                    first_token(a, rid + "-t1")
                    prompt = prefix + [rng.randrange(100, vocab) for _ in range(args.new)]
                    started = time.perf_counter()
                    if mode == "pull":
                        token = pulled(a, b, rid, prompt, n // 16 * 16)
                    else:
                        remote_prefill(prefill, b, rid, prompt)
                    if i:
                        times[mode].append(time.perf_counter() - started)
                    if mode == "pull":  # untimed: P's own KV gives the same first token
                        assert remote_prefill(prefill, a, rid + "-check", prompt) == token
            recompute, pull = (statistics.median(times[m]) for m in ("recompute", "pull"))
            print(f"{n:>7} {recompute:>12.3f} {pull:>8.3f} {recompute / pull:>5.1f}x", flush=True)
    finally:
        for worker in (prefill, a, b):
            worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", type=int, nargs="+", default=[256, 512, 1024, 1536])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
