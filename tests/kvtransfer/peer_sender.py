"""A prefill rank in its own process, for the two-process tests and the benchmark's style.

Run as `python -m tests.kvtransfer.peer_sender` with a JSON config on stdin:
    {"layout": {...KVLayout fields}, "source": [host, port, rank], "seed": int,
     "num_blocks": int, "transfers": [[encoded descriptor, [src block ids]], ...],
     "mode": "all" | "stall", "stall_s": float}
"all" pushes every layer then DONE, prints "done" and exits 0. "stall" pushes every layer but
the last, prints "stalled" and sleeps (the fault test kills it there), exiting by itself after
stall_s. stdout carries only those status lines. The cluster secret comes from the
environment ($PDSERVE_CLUSTER_SECRET), as a worker's does.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import torch


def main() -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from pdserve.cluster_secret import ClusterSecret
    from pdserve.kvtransfer import Endpoint, GlooConnector, KVLayout, KVSender, TransferDescriptor
    from tests.kvtransfer.kvdata import full_caches

    cfg = json.loads(sys.stdin.readline())
    layout = KVLayout(**cfg["layout"])
    source = Endpoint(*cfg["source"])
    caches = full_caches(layout, cfg["num_blocks"], cfg["seed"])
    connector = GlooConnector(source, connect_timeout_s=10, secret=ClusterSecret.from_env())
    sender = KVSender(layout, connector, 1, caches)
    batch = [(TransferDescriptor.decode(d), src) for d, src in cfg["transfers"]]
    plans = sender.plan(batch)
    last = layout.num_layers if cfg["mode"] == "all" else layout.num_layers - 1
    handles = [sender.push_layer(layer, p) for layer in range(last) for p in plans]
    for h in handles:
        h.wait()
    if cfg["mode"] == "stall":
        print("stalled", flush=True)
        time.sleep(cfg.get("stall_s", 30.0))
        return 1
    for p in plans:
        sender.finish(p).wait()
    sender.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
