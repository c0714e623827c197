"""KV transfer bandwidth: kvtransfer's layer-by-layer push vs raw gloo, between two processes.

    python benchmarks/kv_transfer.py [--tokens 2048] [--repeat 7] [--threads 1]
    python benchmarks/kv_transfer.py --layouts mla gqa    # DeepSeek-V3's latent vs GQA-8

The KV of one SmolLM2-135M prompt (30 layers, 3 KV heads, head_dim 64, fp32, block size 16;
2048 tokens = 128 blocks = 3 MiB per layer, 94.4 MB in all) is moved from a "prefill" process
to a "decode" process (this one) over real gloo on 127.0.0.1:

    kvtransfer  KVSender.push_layer for each layer (pack + header + payload, non-blocking), wait
                all, DONE; KVReceiver validates each header, receives into staging, unpacks
                into scattered destination blocks; timed until KVReceiver.wait() returns
    raw gloo    one send/recv of a contiguous tensor of the same total size, same store,
                same processes, pre-allocated buffers on both sides

kvtransfer runs twice: into consecutive destination blocks (a fresh pool: sent from and
received straight into the caches, no copy) and into scattered ones (a fragmented pool:
received into staging, then unpacked: one more copy of every byte). Both are timed on this
side, from the command to the prefill process (a pipe write) until the data is in place; runs
are interleaved, the best and the median of `--repeat` runs after a warm-up are reported, and
the target is kvtransfer >= 70% of raw. Each process runs `--threads` torch threads (gloo adds
its own I/O threads); on a 2-core host the scattered case's extra copy competes with gloo's
two I/O threads for the cores, so it is the case to watch there. `prefill_overlap` is the
hook for the prefill+transfer vs prefill-alone figure once the prefill worker exists.

`--layouts` moves other models' KV the same way, one after the other, and prints bytes and
time per prompt token for each: `mla` is DeepSeek-V3's latent cache (61 layers, one entry of
512 + 64 values per token, bf16, the same on every TP rank: `kvtransfer.layout`'s "latent"
kind, sent from and landed in the one-tensor cache through `transfer_view`); `gqa` is the same
model with a GQA cache of 8 KV heads of 128 (Llama 3 70B's shape). `--overlap` is SmolLM2's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve import defaults
from pdserve.cluster_secret import ClusterSecret
from pdserve.kvtransfer import (
    Endpoint,
    GlooConnector,
    GlooListener,
    KVLayout,
    KVReceiver,
    KVSender,
    TransferDescriptor,
)
from pdserve.kvtransfer.layout import transfer_view

SMOLLM2 = KVLayout("SmolLM2-135M-Instruct", "float32", block_size=16, num_layers=30,
                   num_kv_heads=3, head_dim=64)
LAYOUTS = {
    "smollm2": SMOLLM2,
    "mla": KVLayout("DeepSeek-V3", "bfloat16", 16, 61, 1, (512 + 64) // 2, "latent"),
    "gqa": KVLayout("DeepSeek-V3-as-GQA-8", "bfloat16", 16, 61, 8, 128),
}
SOURCE = Endpoint(defaults.HOST, 1, 0)
WORKER_SOURCE = Endpoint(defaults.HOST, 2, 0)  # the PrefillWorker's own channel identity
RAW_TAG = 7


def make_caches(layout: KVLayout, num_blocks: int, fill) -> list[tuple[torch.Tensor, ...]]:
    """The model runner's caches of `layout` (a latent cache: one tensor per layer), as a
    transfer sees them (`transfer_view`); `fill(shape)` makes each tensor."""
    block = (num_blocks, layout.block_size)
    if layout.kind == "latent":
        caches = [(fill((*block, 2 * layout.head_dim)).to(layout.torch_dtype),)
                  for _ in range(layout.num_layers)]
    else:
        shape = (*block, layout.num_kv_heads, layout.head_dim)
        caches = [(fill(shape).to(layout.torch_dtype), fill(shape).to(layout.torch_dtype))
                  for _ in range(layout.num_layers)]
    return transfer_view(layout, caches)


def raw_group(port: int, rank: int) -> dist.ProcessGroupGloo:
    store = dist.TCPStore(defaults.HOST, port, None, False, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=60)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=defaults.HOST)]
    return dist.ProcessGroupGloo(dist.PrefixStore("bench/raw", store), rank, 2, opts)


def prefill_engines(tokens: int, threads: int):
    """A PrefillWorker pushing to the decode process, and a bare EngineCore as the baseline:
    the same SmolLM2 prompt, prefix caching off so every run computes all of it."""
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, load_model_config
    from pdserve.engine.default_model import ensure_default_model
    from pdserve.engine.engine_core import EngineCore
    from pdserve.prefill_worker.worker import PrefillWorker

    blocks = -(-tokens // SMOLLM2.block_size) + 8
    config = EngineConfig(
        model=load_model_config(ensure_default_model(), max_model_len=tokens + 16),
        cache=CacheConfig(num_blocks=blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=tokens + 16),
        num_threads=threads,
    )
    worker = PrefillWorker(config, GlooConnector(WORKER_SOURCE, secret=ClusterSecret.from_env()),
                           SMOLLM2.model)
    return worker, EngineCore(config)


def prefill_alone(core, prompt: list[int]) -> float:
    from pdserve.engine.request import Request
    from pdserve.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    core.add_request(Request(f"alone-{start}", tuple(prompt), SamplingParams(max_tokens=1)))
    while core.has_unfinished_requests():
        core.step()
    return time.perf_counter() - start


def prefill_and_push(worker, prompt: list[int], desc: TransferDescriptor) -> float:
    from pdserve.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    worker.prefill(desc.request_id, prompt, SamplingParams(max_tokens=1), desc).result()
    return time.perf_counter() - start


# ---- the prefill process ----

def sender_main(layout: KVLayout, port: int, num_blocks: int, threads: int, overlap: bool
                ) -> None:
    torch.set_num_threads(threads)
    if overlap:
        worker, core = prefill_engines(num_blocks * layout.block_size, threads)
        prompt = torch.randint(3, 49152, (num_blocks * layout.block_size,)).tolist()
    g = torch.Generator().manual_seed(0)
    caches = make_caches(layout, num_blocks, lambda shape: torch.rand(shape, generator=g))
    sender = KVSender(layout, GlooConnector(SOURCE, secret=ClusterSecret.from_env()), 1, caches)
    raw = raw_group(port, 0)
    raw_buf = torch.ones(layout.num_layers * num_blocks * layout.block_nbytes(layout.num_kv_heads),
                         dtype=torch.uint8)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "kv":
            desc = TransferDescriptor.decode(arg)
            plans = sender.plan([(desc, list(range(desc.num_blocks)))])
            handles = [sender.push_layer(layer, p) for layer in range(layout.num_layers)
                       for p in plans]
            for h in handles:
                h.wait()
            for p in plans:
                sender.finish(p).wait()
        elif cmd == "raw":
            raw.send([raw_buf], 1, RAW_TAG).wait()
        elif cmd == "alone":
            print(f"ok {prefill_alone(core, prompt)}", flush=True)
            continue
        elif cmd == "push":
            desc = TransferDescriptor.decode(arg)
            print(f"ok {prefill_and_push(worker, prompt, desc)}", flush=True)
            continue
        else:
            break
        print("ok", flush=True)
    sender.close()
    if overlap:
        worker.close()


# ---- the decode process (this one) ----

class Bench:
    def __init__(self, name: str, num_blocks: int, threads: int, overlap: bool) -> None:
        self.layout, self.num_blocks = LAYOUTS[name], num_blocks
        secret = ClusterSecret.generate()  # the sender process gets it in its environment
        self.listener = GlooListener(defaults.HOST, secret=secret)
        self.caches = make_caches(self.layout, 2 * num_blocks, torch.zeros)
        self.rx = KVReceiver(self.layout, self.listener, 1, self.caches)
        self.peer = subprocess.Popen(
            [sys.executable, __file__, "--role", "sender", "--layouts", name, "--port",
             str(self.listener.endpoint.port), "--blocks", str(num_blocks), "--threads",
             str(threads), *(["--overlap"] if overlap else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, **secret.to_env()))
        self.raw = raw_group(self.listener.endpoint.port, 1)
        self.raw_buf = torch.empty(self.layout.num_layers * num_blocks
                                   * self.layout.block_nbytes(self.layout.num_kv_heads),
                                   dtype=torch.uint8)

    def command(self, line: str) -> None:
        assert self.peer.stdin is not None
        self.peer.stdin.write(line + "\n")
        self.peer.stdin.flush()

    def ack(self) -> None:
        assert self.peer.stdout is not None
        if self.peer.stdout.readline().strip() != "ok":
            raise RuntimeError("the prefill process failed (see its stderr)")

    def kv_once(self, scattered: bool) -> float:
        """Scattered: random destination blocks (a fragmented pool: staged + unpacked).
        Contiguous: consecutive ones (a fresh pool: received straight into the cache)."""
        if scattered:
            blocks = torch.randperm(2 * self.num_blocks)[:self.num_blocks].tolist()
        else:
            first = int(torch.randint(0, self.num_blocks + 1, ()))
            blocks = list(range(first, first + self.num_blocks))
        desc = TransferDescriptor.new("bench", self.layout, [SOURCE],
                                      [(self.listener.endpoint, blocks)], time.time() + 60)
        self.rx.expect(desc)
        start = time.perf_counter()
        self.command(f"kv {desc.encode().decode()}")
        self.rx.wait(desc.transfer_id)
        elapsed = time.perf_counter() - start
        self.ack()
        return elapsed

    def raw_once(self) -> float:
        work = self.raw.recv([self.raw_buf], 0, RAW_TAG)
        start = time.perf_counter()
        self.command("raw")
        work.wait()
        elapsed = time.perf_counter() - start
        self.ack()
        return elapsed

    def timed_reply(self) -> float:
        assert self.peer.stdout is not None
        word, _, seconds = self.peer.stdout.readline().strip().partition(" ")
        if word != "ok":
            raise RuntimeError("the prefill process failed (see its stderr)")
        return float(seconds)

    def alone_once(self) -> float:
        self.command("alone")
        return self.timed_reply()

    def push_once(self) -> float:
        """A real PrefillWorker step: the prompt's KV pushed layer by layer as it computes."""
        blocks = list(range(self.num_blocks))
        desc = TransferDescriptor.new("overlap", self.layout, [WORKER_SOURCE],
                                      [(self.listener.endpoint, blocks)], time.time() + 600)
        self.rx.expect(desc)
        self.command(f"push {desc.encode().decode()}")
        elapsed = self.timed_reply()
        self.rx.wait(desc.transfer_id)
        return elapsed

    def close(self) -> None:
        self.command("quit")
        self.peer.wait(timeout=30)
        self.rx.close()


def run(name: str, args: argparse.Namespace) -> dict:
    """One layout's runs (see the module doc); prints them and returns the numbers."""
    layout = LAYOUTS[name]
    num_blocks = -(-args.tokens // layout.block_size)
    nbytes = layout.num_layers * num_blocks * layout.block_nbytes(layout.num_kv_heads)
    bench = Bench(name, num_blocks, args.threads, args.overlap)
    overlap: dict[str, list[float]] = {"prefill alone": [], "prefill + push": []}
    try:
        runs = {"kv contiguous": [], "kv scattered": [], "raw gloo": []}
        for i in range(args.repeat + 1):  # run 0 warms up (channel setup, first-touch pages)
            times = (bench.kv_once(False), bench.kv_once(True), bench.raw_once())
            for key, t in zip(runs, times):
                if i:
                    runs[key].append(t)
        for i in range(args.overlap_repeat + 1 if args.overlap else 0):  # interleaved
            times = (bench.alone_once(), bench.push_once())
            for key, t in zip(overlap, times):
                if i:
                    overlap[key].append(t)
    finally:
        bench.close()
    print(f"{layout.model} KV of a {args.tokens}-token prompt ({layout.kind}): "
          f"{layout.num_layers} layers x {num_blocks} blocks, "
          f"{layout.block_nbytes(layout.num_kv_heads) * num_blocks / 2**20:.1f} MiB/layer, "
          f"{nbytes / 1e6:.1f} MB; 2 processes on 127.0.0.1, {args.threads} torch thread(s) each")
    best = {key: min(times) for key, times in runs.items()}
    for key, times in runs.items():
        print(f"  {key:<13} best {best[key] * 1e3:7.2f} ms  {nbytes / best[key] / 1e9:5.2f} GB/s"
              f"   median {statistics.median(times) * 1e3:7.2f} ms  "
              f"{nbytes / statistics.median(times) / 1e9:5.2f} GB/s")
    median = {key: statistics.median(times) for key, times in runs.items()}
    ratios = {}
    for key in ("kv contiguous", "kv scattered"):
        ratios[key] = {"best": best["raw gloo"] / best[key],
                       "median": median["raw gloo"] / median[key]}
        print(f"  {key} / raw gloo: best {ratios[key]['best']:.0%}, median "
              f"{ratios[key]['median']:.0%} (target >= 70%)")
    result = {"layout": name, "bytes": nbytes, "bytes_per_token": nbytes / args.tokens,
              "best_s": best, "median_s": median, "ratio": ratios}
    if args.overlap:
        alone, pushed = (statistics.median(overlap[k]) for k in overlap)
        print(f"  SmolLM2 prefill of {args.tokens} tokens: alone {alone:.3f} s, with layer-wise "
              f"push {pushed:.3f} s (medians of {args.overlap_repeat}): "
              f"{pushed / alone:.3f}x (target <= 1.15x)")
        result["overlap"] = {"alone_s": alone, "with_push_s": pushed, "ratio": pushed / alone}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--layouts", nargs="+", default=["smollm2"], choices=tuple(LAYOUTS),
                        help="whose KV to move, one after the other (see the module doc)")
    parser.add_argument("--role", default="decode", choices=("decode", "sender"))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=0)
    parser.add_argument("--overlap", action="store_true",
                        help="also time a real SmolLM2 prefill alone vs with its KV pushed")
    parser.add_argument("--overlap-repeat", type=int, default=3)
    args = parser.parse_args()
    if args.overlap and args.layouts != ["smollm2"]:
        parser.error("--overlap runs a SmolLM2 prefill: use it with --layouts smollm2")
    if args.role == "sender":
        sender_main(LAYOUTS[args.layouts[0]], args.port, args.blocks, args.threads, args.overlap)
        return
    torch.set_num_threads(args.threads)
    results = [run(name, args) for name in args.layouts]
    if len(results) > 1:
        print(f"per prompt token ({args.tokens}-token prompt, kv contiguous, median):")
        first = results[0]
        for r in results:
            seconds = r["median_s"]["kv contiguous"]
            print(f"  {r['layout']:<8} {r['bytes_per_token'] / 1024:8.1f} KiB  "
                  f"{seconds / args.tokens * 1e6:8.2f} us  ({r['bytes'] / first['bytes']:.2f}x "
                  f"the bytes, {seconds / first['median_s']['kv contiguous']:.2f}x the time of "
                  f"{first['layout']})")
    print(json.dumps(results if len(results) > 1 else results[0]))


if __name__ == "__main__":
    main()
