"""Registry: one deployment's worker table, as other routers of it read it from Ray's GCS.

The deployment that owns the worker pools (`pdserve up`) publishes, in Ray's GCS key-value
store, every worker's id, role, gRPC address and state (up / down / draining), and what
another router needs to join it: the model name, block size and mode (a router of another
model must refuse to start, not serve garbage) and the Redis URL, never its password. A router
started with `--router-only` reads it there (pdserve.launch.router_only) and follows it.

The document is strict JSON (never pickle: anything that can write to the GCS could otherwise
run code in every router), read through `decode`, which checks every type, bound and size and
raises ValueError for anything else. One key per deployment, derived from `redis_namespace`,
so two deployments on one Ray cluster don't collide. `diff` turns two tables into the worker
changes a router applies. Everything but the three GCS calls is pure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pdserve.launch.worker import DECODE, PREFILL

VERSION = 1
KV_NAMESPACE = "pdserve"  # Ray's GCS namespace; the key names the deployment
MAX_BYTES = 1 << 20
MAX_WORKERS = 4096
MAX_TEXT = 512  # characters of a model name, Redis URL or namespace
UP, DOWN, DRAINING = "up", "down", "draining"
STATES = (UP, DOWN, DRAINING)
_WORKER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):([0-9]{1,5})")
_HEADER = {"model_name": str, "block_size": int, "mode": str, "redis_namespace": str,
           "owner": str, "revision": int}


@dataclass(frozen=True)
class WorkerEntry:
    worker_id: str
    role: str  # prefill | decode
    address: str  # host:port of its gRPC server
    state: str  # up | down | draining


@dataclass(frozen=True)
class Registry:
    model_name: str
    block_size: int
    mode: str  # disaggregated | colocated
    redis_url: str | None  # without its password
    redis_namespace: str
    owner: str  # names one publisher: a restarted owner is another, its revisions restart
    revision: int  # bumped by every change the owner publishes
    workers: tuple[WorkerEntry, ...]

    def table(self) -> dict[str, WorkerEntry]:
        return {w.worker_id: w for w in self.workers}


@dataclass(frozen=True)
class Change:
    """One step that brings a router's table to the registry's."""

    op: Literal["add", "down", "drain"]
    worker_id: str
    entry: WorkerEntry | None = None  # what to register (op "add")


def registry_key(redis_namespace: str) -> str:
    return f"registry/{redis_namespace}"


def encode(registry: Registry) -> bytes:
    data = {"version": VERSION, **asdict(registry)}
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def decode(data: bytes) -> Registry:
    """The registry in `data`; ValueError saying what is wrong with it."""
    if not isinstance(data, bytes) or len(data) > MAX_BYTES:
        raise ValueError(f"the registry must be at most {MAX_BYTES} bytes of JSON")
    try:
        doc = json.loads(data, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the registry is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"the registry must be a JSON object of version {VERSION}")
    header = {name: _field(doc, name, kind) for name, kind in _HEADER.items()}
    if not 1 <= header["block_size"] <= 1 << 16 or header["revision"] < 0:
        raise ValueError("the registry's block_size or revision is out of bounds")
    redis_url = doc.get("redis_url")
    if redis_url is not None and (not isinstance(redis_url, str) or len(redis_url) > MAX_TEXT
                                  or "@" in redis_url):
        raise ValueError("the registry's redis_url must be a URL without credentials")
    workers = doc.get("workers")
    if not isinstance(workers, list) or len(workers) > MAX_WORKERS:
        raise ValueError(f"the registry's workers must be a list of at most {MAX_WORKERS}")
    entries = tuple(_entry(w) for w in workers)
    if len({e.worker_id for e in entries}) != len(entries):
        raise ValueError("the registry names a worker twice")
    return Registry(redis_url=redis_url, workers=entries, **header)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _field(doc: Mapping[str, Any], name: str, kind: type) -> Any:
    value = doc.get(name)
    if type(value) is not kind or (kind is str and not 0 < len(value) <= MAX_TEXT):
        raise ValueError(f"the registry's {name} must be a {kind.__name__}, got {value!r:.80}")
    return value


def _entry(item: Any) -> WorkerEntry:
    if not isinstance(item, dict) or set(item) != {"worker_id", "role", "address", "state"}:
        raise ValueError("a registry worker must be an object of worker_id, role, address, "
                         "state")
    entry = WorkerEntry(**item)
    if not isinstance(entry.worker_id, str) or not _WORKER_ID.fullmatch(entry.worker_id):
        raise ValueError(f"a registry worker_id is malformed: {entry.worker_id!r:.80}")
    if entry.role not in (PREFILL, DECODE) or entry.state not in STATES:
        raise ValueError(f"worker {entry.worker_id}: role must be prefill or decode and state "
                         f"one of {STATES}, got {entry.role!r:.20} / {entry.state!r:.20}")
    match = _ADDRESS.fullmatch(entry.address) if isinstance(entry.address, str) else None
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"worker {entry.worker_id}: address must be host:port, got "
                         f"{entry.address!r:.80}")
    return entry


def incompatibility(registry: Registry, model_name: str, block_size: int,
                    mode: str) -> str | None:
    """Why a router of this model, block size and mode can't serve the deployment, or None."""
    for name, mine, theirs in (("model", model_name, registry.model_name),
                               ("block_size", block_size, registry.block_size),
                               ("mode", mode, registry.mode)):
        if mine != theirs:
            return (f"this router's {name} is {mine!r}, the deployment's is {theirs!r}: start "
                    f"the router with the deployment's settings (its --config)")
    return None


def diff(old: Mapping[str, WorkerEntry], new: Mapping[str, WorkerEntry]) -> list[Change]:
    """What a router that registered `old` does to follow `new`: register a worker that is new,
    moved (a restart: another address) or back up; mark one down; drain one that is draining
    or gone. A draining worker it never had stays unknown to it."""
    changes: list[Change] = []
    for worker_id, entry in new.items():
        was = old.get(worker_id)
        if entry.state == DRAINING:
            if was is not None and was.state != DRAINING:
                changes.append(Change("drain", worker_id))
            continue
        moved = was is None or was.state == DRAINING or (was.role, was.address) != (
            entry.role, entry.address)
        if moved or (entry.state == UP and was.state == DOWN):
            changes.append(Change("add", worker_id, entry))
        if entry.state == DOWN and (moved or was.state == UP):
            changes.append(Change("down", worker_id))
    changes += [Change("drain", worker_id) for worker_id, was in old.items()
                if worker_id not in new and was.state != DRAINING]
    return changes


# ---- Ray's GCS (blocking: call from a thread) ----

def put(redis_namespace: str, data: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(registry_key(redis_namespace), data, overwrite=True,
                                 namespace=KV_NAMESPACE)


def get(redis_namespace: str) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(registry_key(redis_namespace), namespace=KV_NAMESPACE)


def delete(redis_namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(registry_key(redis_namespace), namespace=KV_NAMESPACE)
