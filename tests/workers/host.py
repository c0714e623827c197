"""Run a prefill worker or one decode rank as a plain process, driven by JSON lines.

    python -m tests.workers.host < config line, then command lines
A command is {"op": ..., ...}; every answer is one JSON line. No pickle crosses the pipe.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from pdserve.cluster_secret import ClusterSecret
from pdserve.decode_worker.actor import tp_group
from pdserve.decode_worker.group import start_decode_rank
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.kvtransfer.rendezvous import GlooConnector, GlooListener
from pdserve.prefill_worker.worker import PrefillWorker
from tests.workers.pd import MODEL_NAME, Streams, engine_config


def answer(**body) -> None:
    sys.stdout.write(json.dumps(body) + "\n")
    sys.stdout.flush()


def serve_prefill(cfg: dict) -> None:
    source = Endpoint("127.0.0.1", cfg["identity_port"], 0)
    worker = PrefillWorker(engine_config(cfg["model_dir"]),
                           GlooConnector(source, secret=ClusterSecret.from_env()), MODEL_NAME)
    die_after = cfg.get("die_after_layer_pushes")
    if die_after is not None:  # fault injection: the process dies in the middle of a push
        sender = worker.connector.sender
        push, count = sender.push_layer, [0]

        def push_then_die(layer, plan):
            count[0] += 1
            if count[0] > die_after:
                os._exit(17)
            return push(layer, plan)

        sender.push_layer = push_then_die
    futures = {}
    answer(ready=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "prefill":
            params = SamplingParams(**cmd["params"])
            descriptor = TransferDescriptor.decode(cmd["descriptor"])
            futures[cmd["id"]] = worker.prefill(cmd["id"], cmd["prompt"], params, descriptor,
                                                lora=_lora(cmd))
            answer(ok=True)
        elif cmd["op"] == "result":
            try:
                answer(first_token=futures.pop(cmd["id"]).result(timeout=60).first_token)
            except Exception as exc:
                answer(error=str(exc))
        elif cmd["op"] == "stats":
            answer(**dataclasses.asdict(worker.stats()))
        elif cmd["op"] == "close":
            worker.close()
            answer(closed=True)
            return


def serve_decode(cfg: dict) -> None:
    rank, size = cfg["rank"], cfg["tp_size"]
    secret = ClusterSecret.from_env()
    store = dist.TCPStore("127.0.0.1", cfg["tp_port"], None, rank == 0, wait_for_workers=False)
    group = tp_group(store, "127.0.0.1", rank, size,
                     datetime.timedelta(seconds=cfg.get("tp_timeout_s", 60)))
    if rank == 0:
        listener = GlooListener("127.0.0.1", rank=0, secret=secret)
        store.set("kv_port", str(listener.endpoint.port))
    else:
        port = int(store.get("kv_port"))
        listener = GlooListener("127.0.0.1", rank=rank, port=port, host_store=False,
                                secret=secret)
    endpoints = [Endpoint("127.0.0.1", listener.endpoint.port, r) for r in range(size)]
    config = engine_config(cfg["model_dir"], num_blocks=cfg.get("num_blocks", 256))
    tp = TensorParallel(rank, size, group, expert_parallel=cfg.get("expert_parallel", False))
    worker = start_decode_rank(config, tp, listener, endpoints,
                               MODEL_NAME, max_reservation_s=cfg.get("max_reservation_s", 30.0),
                               tp_beat_s=cfg.get("tp_beat_s", 2.0))
    if worker is None:
        return
    answer(ready=True, endpoint=[listener.endpoint.host, listener.endpoint.port, 0])
    streams = Streams(worker)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "reserve":
            params = SamplingParams(**cmd["params"])
            descriptor = worker.reserve(cmd["id"], cmd["prompt"], params,
                                        [Endpoint(*cmd["source"])], cmd["deadline"],
                                        lora=_lora(cmd))
            answer(descriptor=descriptor.encode().decode() if descriptor else None)
        elif cmd["op"] == "start":
            worker.start(cmd["id"], cmd["first_token"])
            answer(ok=True)
        elif cmd["op"] == "collect":
            tokens, last = streams.collect(cmd["id"], timeout=120)
            answer(tokens=tokens, finish_reason=last.finish_reason, error=last.error)
        elif cmd["op"] == "stats":
            answer(**dataclasses.asdict(worker.stats()))
        elif cmd["op"] == "close":
            worker.close()
            answer(closed=True)
            return


def _lora(cmd: dict) -> LoRARequest | None:
    return LoRARequest(**cmd["lora"]) if cmd.get("lora") else None


def main() -> None:
    torch.set_num_threads(1)
    cfg = json.loads(sys.stdin.readline())
    try:
        (serve_prefill if cfg["role"] == "prefill" else serve_decode)(cfg)
    except Exception:
        answer(error=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
