"""DecodeRankActor: one rank of a decode tensor-parallel group as a Ray actor.

Bootstrap, driven by the launcher (every rank lives in one placement group, so on one node):
    rank 0   __init__ binds the TP group's TCPStore and its KV listener (which hosts the KV
             rendezvous store), both on `spec.host` only; `rendezvous()` reports their ports
    all      start(rendezvous) forms the TP group (`make_tp`: gloo for CPU tensors, plus
             NCCL for device tensors when the spec's device is CUDA) and calls
             `start_decode_rank`: rank 0 serves its DecodeWorker over gRPC and returns the
             address; the other ranks follow rank 0 in a thread and return None at once
The KV listeners (`kv_listener`) carry tensors of the spec's device (NCCL data groups on
CUDA), as the prefill side's connector does (prefill_worker.service); so does a TP-1
worker's sender transport (`pull_transport`), which pushes its cached prefixes to other decode
workers that pull them.
The actor must run with max_concurrency >= 2, so `ping` answers while a rank follows.
The cluster secret comes from the actor's environment (the pool's runtime_env), never args.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pdserve.cluster_secret import ClusterSecret
from pdserve.decode_worker.group import start_decode_rank
from pdserve.decode_worker.service import DecodeService
from pdserve.engine.models.parallel import TensorParallel
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.device_groups import (
    IdentityFn,
    collective_backend,
    gather_identities,
    local_identity,
    nccl_group,
    shared_gpu_reason,
)
from pdserve.kvtransfer.rendezvous import GlooConnector, GlooListener
from pdserve.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 120.0  # every rank joins within this (each loads its shard first)


def tp_group(store: dist.Store, host: str, rank: int, size: int, timeout: timedelta) -> Any:
    """The TP group's gloo side: its CPU tensors (all of a CPU model's); each collective fails
    after `timeout` (WorkerSpec.tp_timeout_s). A follower idles blocked in the next
    broadcast: rank 0's "idle" beats (plan_broadcast) keep that wait short, so only a hung
    or dead rank makes a collective time out."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, opts)


def make_tp(
    store: dist.Store, host: str, rank: int, size: int, device: torch.device | str,
    timeout: timedelta, expert_parallel: bool = False, *, identity: IdentityFn = local_identity,
) -> TensorParallel:
    """This rank's TensorParallel for a model on `device`: the gloo group (`tp_group`) and,
    on CUDA, an NCCL group for device tensors, formed once the ranks proved to be on
    distinct GPUs (`identity(device)` gathered over the gloo group; ValueError otherwise)."""
    device = torch.device(device)
    group, device_group = tp_group(store, host, rank, size, timeout), None
    if collective_backend(device) == "nccl":
        mine = identity(device)
        try:
            ranks = gather_identities(group, size, mine, timeout)
        except (RuntimeError, ValueError) as e:
            raise RuntimeError(f"TP rank {rank}: device identities not gathered: {e}") from None
        why = shared_gpu_reason(ranks, f"decode TP group of {size}",
                                "give each decode rank its own GPU (Ray num_gpus=1 per rank)")
        if why is not None:
            raise ValueError(why)
        device_group = nccl_group(dist.PrefixStore("tp/nccl", store), rank, size, timeout)
    return TensorParallel(rank, size, group, expert_parallel, device_group)


def kv_listener(spec: WorkerSpec, secret: ClusterSecret, rank: int = 0, port: int = 0,
                store_host: str | None = None) -> GlooListener:
    """Rank `rank`'s KV listener, bound on its own host: rank 0's hosts the rendezvous store,
    another rank's joins it at `store_host:port` (rank 0's node, maybe not its own); its data
    groups carry tensors of the spec's device (NCCL on CUDA)."""
    return GlooListener(spec.host, rank=rank, port=port, host_store=store_host is None,
                        device=spec.device, connect_timeout_s=CONNECT_TIMEOUT_S, secret=secret,
                        store_host=store_host)


def pull_transport(spec: WorkerSpec, secret: ClusterSecret, endpoints: list[Endpoint],
                   tp_size: int) -> GlooConnector | None:
    """A TP-1 worker's KV sender transport for pushing prefixes to other decode workers
    (decode_worker.prefix_push): its identity is its KV listener's endpoint, its data groups
    carry the spec's device. None for a TP group (each rank holds a shard: no pulls from it)."""
    if tp_size > 1:
        return None
    return GlooConnector(endpoints[0], device=spec.device, secret=secret)


class DecodeRankActor:
    def __init__(self, spec: dict[str, Any], rank: int, tp_size: int) -> None:
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} is not in a TP group of {tp_size}")
        self.given = spec
        self.spec = WorkerSpec.from_dict(spec).with_resolved_host()
        self.rank, self.tp_size = rank, tp_size
        self.secret = ClusterSecret.from_env()
        self.timeout = timedelta(seconds=CONNECT_TIMEOUT_S)
        self.service: DecodeService | None = None
        self.listener: GlooListener | None = None
        self.tp_store: dist.TCPStore | None = None
        self.follower: threading.Thread | None = None
        self.follower_error: BaseException | None = None
        if rank == 0:
            self.listener = kv_listener(self.spec, self.secret)
            if tp_size > 1:
                sock = socket.create_server((self.spec.host, 0), backlog=128)
                # TCPStore takes the bound socket, so the store listens on spec.host only.
                self.tp_store = dist.TCPStore(
                    self.spec.host, sock.getsockname()[1], None, True, timeout=self.timeout,
                    wait_for_workers=False, master_listen_fd=sock.detach(),
                )

    def rendezvous(self) -> dict[str, Any]:
        """Rank 0: where the other ranks join (`start`'s argument)."""
        if self.rank != 0:
            raise ValueError("only rank 0 hosts the rendezvous")
        return {
            "host": self.spec.host, "kv_port": self.listener.endpoint.port,
            "tp_port": self.tp_store.port if self.tp_store is not None else None,
        }

    def start(self, rendezvous: dict[str, Any]) -> str | None:
        """Rank 0: its gRPC address once serving. Other ranks: None (they follow in a thread)."""
        host, kv_port = rendezvous["host"], int(rendezvous["kv_port"])
        tp = TensorParallel()
        if self.tp_size > 1:
            store = self.tp_store or dist.TCPStore(
                host, int(rendezvous["tp_port"]), None, False, timeout=self.timeout,
                wait_for_workers=False,
            )
            tp = make_tp(store, self.spec.host, self.rank, self.tp_size, self.spec.device,
                         timedelta(seconds=self.spec.tp_timeout_s),
                         self.spec.enable_expert_parallel)
        if self.listener is None:
            self.listener = kv_listener(self.spec, self.secret, self.rank, kv_port,
                                        store_host=host)
        endpoints = [Endpoint(host, kv_port, r) for r in range(self.tp_size)]
        args = (self.spec.engine_config(), tp, self.listener, endpoints, self.spec.model_name)
        if self.rank == 0:
            worker = start_decode_rank(*args, max_reservation_s=self.spec.max_reservation_s,
                                       tp_beat_s=self.spec.tp_beat_s,
                                       transport=pull_transport(self.spec, self.secret,
                                                                endpoints, self.tp_size))
            self.service = DecodeService(worker, self.spec.worker_id, self.spec.host,
                                         self.secret, stall_timeout_s=self.spec.stall_timeout_s,
                                         tls=self.spec.tls())
            return self.service.address
        self.follower = threading.Thread(target=self._follow, args=args,
                                         name=f"decode-rank-{self.rank}", daemon=True)
        self.follower.start()
        return None

    def identity(self, challenge: str) -> dict[str, Any]:
        """What an owner adopting this group checks (`Worker.adopt`): the spec and group size
        it was started with and the challenge signed with its cluster secret."""
        return {"spec": self.given, "tp_size": self.tp_size,
                "proof": self.secret.sign("adopt", challenge)}

    def ping(self) -> str | None:
        """Rank 0: its address; others: None. Raises when this rank can no longer serve."""
        if self.rank == 0:
            if self.service is None or not self.service.worker.is_alive():
                raise RuntimeError(f"decode worker {self.spec.worker_id}: not serving")
            return self.service.address
        if self.follower is None or not self.follower.is_alive():
            reason = self.follower_error or "not following rank 0"
            raise RuntimeError(f"decode worker {self.spec.worker_id} rank {self.rank}: {reason}")
        return None

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Rank 0 stops the whole group; a follower only waits for that to reach it."""
        if self.service is not None:
            self.service.stop()
            self.service = None
        elif self.follower is not None:
            self.follower.join(timeout_s)
        if self.rank == 0 and self.listener is not None:
            self.listener.close()
        self.tp_store = None

    def _follow(self, *args: Any) -> None:
        try:
            start_decode_rank(*args)
        except BaseException as exc:  # ping reports it; the supervisor restarts the group
            logger.exception("decode worker %s rank %d failed", self.spec.worker_id, self.rank)
            self.follower_error = exc
