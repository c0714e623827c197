"""Process groups by device: which backend carries a device's tensors, and which GPU a rank is on.

Two kinds of groups carry tensors between worker processes: a KV pair's data group
(kvtransfer.rendezvous) and a decode tensor-parallel group (decode_worker.actor). Both pick
their backend from the worker's device at run time (`collective_backend`): gloo for CPU
tensors, NCCL for CUDA tensors, which gloo cannot send (no CUDA send/recv or all-gather).
Headers, plan messages and votes are CPU tensors and always travel over a gloo group.

NCCL refuses two ranks of one communicator on one physical GPU ("Duplicate GPU detected"),
and only once the first send or collective runs. So before an NCCL group is formed, its ranks
trade a `DeviceIdentity` (GPU UUID and host name, fixed-size bytes: no pickle) over the
group's gloo side, and `shared_gpu` names the clash with its fix. The UUID decides, not the
host: two containers on one machine have different host names and may see the same GPU.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

IDENTITY_BYTES = 256  # one rank's DeviceIdentity on the wire, NUL-padded
_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_MAX_KIND, _MAX_UUID = 16, 64


def collective_backend(device: torch.device | str) -> str:
    """The torch.distributed backend for tensors on `device`: "gloo" (CPU) or "nccl" (CUDA)."""
    kind = torch.device(device).type
    if kind not in _BACKENDS:
        raise ValueError(f"device {str(device)!r}: workers exchange tensors on cpu (gloo) or "
                         "cuda (NCCL) only; run the worker with --device cpu or cuda")
    return _BACKENDS[kind]


def check_transport_device(transport: torch.device | None, kv: torch.device, who: str) -> None:
    """A transport built for one device kind can't carry another's KV (gloo sends no CUDA
    tensor; NCCL no CPU tensor). `transport` None: it carries any device (in-process)."""
    if transport is not None and transport.type != kv.type:
        raise ValueError(f"{who}: the KV cache is on {kv} but its transport was built for "
                         f"{transport}: pass device={kv.type!r} to GlooConnector/GlooListener "
                         "(the worker spec's device)")


@dataclass(frozen=True)
class DeviceIdentity:
    """Where a rank's tensors live: device kind, GPU UUID ("" off GPU), host name."""

    kind: str
    uuid: str = ""
    host: str = ""

    def encode(self) -> bytes:
        """IDENTITY_BYTES of "kind\\nuuid\\nhost", NUL-padded (a long host name is cut)."""
        if (not 0 < len(self.kind) <= _MAX_KIND or len(self.uuid) > _MAX_UUID
                or "\n" in self.kind + self.uuid):
            raise ValueError(f"bad device identity {self!r}")
        raw = f"{self.kind}\n{self.uuid}\n".encode()
        host = self.host.replace("\n", " ").encode()[:IDENTITY_BYTES - len(raw)]
        return (raw + host).ljust(IDENTITY_BYTES, b"\0")

    @classmethod
    def decode(cls, raw: bytes) -> DeviceIdentity:
        """The peer's identity; ValueError for anything `encode` does not make."""
        text = bytes(raw).rstrip(b"\0").decode("utf-8", errors="replace")
        fields = text.split("\n")
        if len(raw) != IDENTITY_BYTES or len(fields) != 3 or not fields[0]:
            raise ValueError("not a device identity (a peer of another pdserve version?)")
        return cls(*fields)


IdentityFn = Callable[[torch.device], DeviceIdentity]  # this process's identity on a device


def local_identity(device: torch.device, cuda: Any = torch.cuda) -> DeviceIdentity:
    """This process's identity for `device`; `cuda` is torch.cuda (tests pass a fake)."""
    host = socket.gethostname()
    if device.type != "cuda":
        return DeviceIdentity(device.type, "", host)
    index = device.index if device.index is not None else cuda.current_device()
    props = cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "")
    if not uuid:  # an old driver: the PCI address tells GPUs of one host apart
        uuid = (f"pci-{getattr(props, 'pci_domain_id', 0)}:{getattr(props, 'pci_bus_id', 0)}"
                f":{getattr(props, 'pci_device_id', 0)}@{host}")
    return DeviceIdentity("cuda", uuid[:_MAX_UUID], host)


def shared_gpu(identities: Sequence[DeviceIdentity]) -> tuple[int, int] | None:
    """The first two ranks on one physical GPU (NCCL refuses them), or None."""
    seen: dict[str, int] = {}
    for rank, ident in enumerate(identities):
        if ident.kind != "cuda" or not ident.uuid:
            continue
        if ident.uuid in seen:
            return seen[ident.uuid], rank
        seen[ident.uuid] = rank
    return None


def shared_gpu_reason(identities: Sequence[DeviceIdentity], what: str, fix: str) -> str | None:
    """Why NCCL can't form `what` over these ranks (with `fix`), or None when it can."""
    clash = shared_gpu(identities)
    if clash is None:
        return None
    a, b = (identities[r] for r in clash)
    return (f"{what}: ranks {clash[0]} (host {a.host}) and {clash[1]} (host {b.host}) are both "
            f"on GPU {a.uuid}, and NCCL cannot put two ranks of a group on one GPU "
            f"(\"Duplicate GPU detected\"): {fix}")


def gather_identities(group: Any, size: int, mine: DeviceIdentity,
                      timeout: timedelta) -> list[DeviceIdentity]:
    """Every rank's identity, by rank, over the gloo `group` (CPU bytes); RuntimeError when a
    rank does not take part within `timeout`, ValueError when one sends garbage."""
    parts = [torch.empty(IDENTITY_BYTES, dtype=torch.uint8) for _ in range(size)]
    own = torch.frombuffer(bytearray(mine.encode()), dtype=torch.uint8)
    group.allgather([parts], [own]).wait(timeout)
    return [DeviceIdentity.decode(p.numpy().tobytes()) for p in parts]


def nccl_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    """An NCCL group of `size` ranks over `store` (CUDA builds of torch only)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)
