"""A latent KV cache into a decode group of two: every rank receives it, or rank 0 receives and
the group broadcasts. Which one pdserve does (`kvtransfer.layout`: every rank) is chosen here.

    python benchmarks/latent_fanout.py [--tokens 2048] [--repeat 5]

Three processes over real gloo on 127.0.0.1: a prefill rank P and decode ranks D0, D1. The
payload is DeepSeek-V3's latent KV of one prompt (61 layers, 576 bf16 values per token),
one message per layer as the layer-wise push sends it:

    direct     P sends each layer to D0 and to D1 (both sends posted at once)
    broadcast  P sends each layer to D0; D0 broadcasts it to the group (D0, D1) as it lands

timed from P's first send until both decode ranks hold every layer (the slower one's clock;
runs interleaved, medians reported). On one host both move the bytes through the same memory;
across hosts `direct` puts d copies on P's link and `broadcast` one, plus the group's own
interconnect.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS, ENTRY = 61, 512 + 64


def rank_main(rank: int, port: int, tokens: int, repeat: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=timedelta(seconds=60))
    world = dist.ProcessGroupGloo(store, rank, 3, timedelta(seconds=60))
    decode = dist.ProcessGroupGloo(dist.PrefixStore("decode", store), rank - 1, 2,
                                   timedelta(seconds=60)) if rank else None
    layers = [torch.full((tokens, ENTRY), float(rank), dtype=torch.bfloat16)
              for _ in range(LAYERS)]
    times: dict[str, list[float]] = {"direct": [], "broadcast": []}
    for i in range(repeat + 1):  # run 0 warms up
        for mode in times:
            world.barrier().wait()
            start = time.perf_counter()
            if rank == 0:
                dests = (1, 2) if mode == "direct" else (1,)
                works = [world.send([t], d, 0) for t in layers for d in dests]
            elif rank == 1 or mode == "direct":
                works = [world.recv([t], 0, 0) for t in layers]
                if mode == "broadcast":  # as each layer lands, to the group
                    for w, t in zip(works, layers):
                        w.wait()
                        decode.broadcast(t, 0).wait()
                    works = []  # waited (a gloo work is waited once)
            else:  # D1 under broadcast: one layer's broadcast after another, as D0 posts them
                works = []
                for t in layers:
                    decode.broadcast(t, 0).wait()
            for w in works:
                w.wait()
            elapsed = torch.tensor([time.perf_counter() - start])
            world.allreduce([elapsed], dist.ReduceOp.MAX).wait()  # the slowest rank's time
            if i:
                times[mode].append(float(elapsed))
    if rank == 0:
        results.update({mode: statistics.median(t) for mode, t in times.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    results = mp.Manager().dict()
    mp.start_processes(rank_main, (free_port(), args.tokens, args.repeat, results), nprocs=3,
                       start_method="spawn")
    nbytes = LAYERS * args.tokens * ENTRY * 2
    print(f"DeepSeek-V3 latent KV of a {args.tokens}-token prompt: {nbytes / 1e6:.1f} MB, "
          f"{LAYERS} messages; P -> decode group of 2, gloo on 127.0.0.1 "
          f"(medians of {args.repeat})")
    for mode in ("direct", "broadcast"):
        print(f"  {mode:<9} {results[mode] * 1e3:8.1f} ms  "
              f"{2 * nbytes / results[mode] / 1e9:5.2f} GB/s into the group")
    print(f"  broadcast / direct: {results['broadcast'] / results['direct']:.2f}x")


def free_port() -> int:
    """A port nothing listens on (the TCPStore binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
