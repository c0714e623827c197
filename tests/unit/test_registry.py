"""The worker registry (pdserve.launch.registry): its JSON, its checks, the changes it implies;
and its publisher and follower over an in-memory stand-in for Ray's GCS."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.launch import registry
from pdserve.launch.registry import Change, Registry, WorkerEntry, decode, diff, encode
from pdserve.launch.registry_follower import RegistryFollower
from pdserve.launch.registry_publisher import RegistryPublisher

P0 = WorkerEntry("prefill-0", "prefill", "127.0.0.1:4000", "up")
D0 = WorkerEntry("decode-0", "decode", "127.0.0.1:5000", "up")
D1 = WorkerEntry("decode-1", "decode", "[::1]:5001", "up")


def reg(*workers: WorkerEntry, owner: str = "owner-a", revision: int = 1, **fields) -> Registry:
    base = dict(model_name="tiny", block_size=16, mode="disaggregated",
                redis_url="redis://127.0.0.1:6379/0", redis_namespace="pdserve")
    return Registry(owner=owner, revision=revision, workers=workers, **{**base, **fields})


def doc(**changes) -> bytes:
    data = json.loads(encode(reg(P0, D0)))
    data.update(changes)
    return json.dumps(data).encode()


def test_round_trip_is_strict_json() -> None:
    r = reg(P0, D0, D1, redis_url=None)
    data = encode(r)
    assert decode(data) == r
    assert json.loads(data)["version"] == registry.VERSION


@pytest.mark.parametrize("data, says", [
    (b"\x80\x04pickle", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"version": 1, "block_size": NaN}', "not JSON"),
    (doc(version=2), "version 1"),
    (doc(block_size="16"), "block_size must be a int"),
    (doc(block_size=0), "out of bounds"),
    (doc(revision=True), "revision must be a int"),
    (doc(model_name=""), "model_name"),
    (doc(redis_url="redis://:secret@host:6379/0"), "without credentials"),
    (doc(workers={"decode-0": {}}), "workers must be a list"),
    (doc(workers=[{"worker_id": "d", "role": "decode", "address": "h:1"}]), "an object of"),
    (doc(workers=[{**vars(D0), "role": "judge"}]), "role must be"),
    (doc(workers=[{**vars(D0), "state": "sleeping"}]), "state"),
    (doc(workers=[{**vars(D0), "worker_id": "bad id/../"}]), "worker_id is malformed"),
    (doc(workers=[{**vars(D0), "address": "127.0.0.1"}]), "host:port"),
    (doc(workers=[{**vars(D0), "address": "127.0.0.1:70000"}]), "host:port"),
    (doc(workers=[{**vars(D0), "address": 5000}]), "host:port"),
    (doc(workers=[vars(D0), vars(D0)]), "twice"),
    (b" " * (registry.MAX_BYTES + 1), "at most"),
])
def test_malformed_registries_are_refused(data: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        decode(data)


def test_too_many_workers_refused() -> None:
    workers = [{**vars(D0), "worker_id": f"d-{i}"} for i in range(registry.MAX_WORKERS + 1)]
    with pytest.raises(ValueError, match="at most"):
        decode(doc(workers=workers))


def test_incompatibility_names_the_setting() -> None:
    r = reg(D0)
    assert registry.incompatibility(r, "tiny", 16, "disaggregated") is None
    assert "block_size is 32" in registry.incompatibility(r, "tiny", 32, "disaggregated")
    assert "model is 'other'" in registry.incompatibility(r, "other", 16, "disaggregated")
    assert "mode" in registry.incompatibility(r, "tiny", 16, "colocated")


def table(*workers: WorkerEntry) -> dict[str, WorkerEntry]:
    return {w.worker_id: w for w in workers}


def state(entry: WorkerEntry, value: str, address: str | None = None) -> WorkerEntry:
    return WorkerEntry(entry.worker_id, entry.role, address or entry.address, value)


def test_diff_from_nothing_registers_all_but_draining() -> None:
    new = table(P0, state(D0, "down"), state(D1, "draining"))
    assert diff({}, new) == [Change("add", "prefill-0", P0),
                             Change("add", "decode-0", state(D0, "down")),
                             Change("down", "decode-0")]


def test_diff_follows_a_restart_a_death_and_drains() -> None:
    old = table(P0, D0, D1)
    assert diff(old, old) == []
    # decode-0 died (down), then came back at another address (up)
    assert diff(old, table(P0, state(D0, "down"), D1)) == [Change("down", "decode-0")]
    moved = state(D0, "up", "127.0.0.1:5999")
    assert diff(table(P0, state(D0, "down"), D1), table(P0, moved, D1)) == [
        Change("add", "decode-0", moved)]
    # back up at the same address: registered again (the client here may have given up)
    assert diff(table(state(D0, "down")), table(D0)) == [Change("add", "decode-0", D0)]
    # draining, then gone: drained once
    assert diff(old, table(P0, D0, state(D1, "draining"))) == [Change("drain", "decode-1")]
    assert diff(table(P0, D0, state(D1, "draining")), table(P0, D0)) == []
    assert diff(old, table(P0, D0)) == [Change("drain", "decode-1")]


class FakeGCS:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, ns: str, data: bytes) -> None:
        self.data[ns] = data

    def get(self, ns: str) -> bytes | None:
        return self.data.get(ns)

    def delete(self, ns: str) -> None:
        self.data.pop(ns, None)


class FakeRouter:
    """The worker-table half of a Router, recording what it was told."""

    def __init__(self) -> None:
        self.prefill: dict[str, str] = {}
        self.decode: dict[str, str] = {}
        self.calls: list[tuple] = []

    async def add_worker(self, worker_id: str, role: str, address: str) -> None:
        (self.prefill if role == "prefill" else self.decode)[worker_id] = address
        self.calls.append(("add", worker_id, address))

    def mark_down(self, worker_id: str) -> None:
        self.calls.append(("down", worker_id))

    async def drain(self, worker_id: str, timeout_s: float) -> None:
        self.prefill.pop(worker_id, None)
        self.decode.pop(worker_id, None)
        self.calls.append(("drain", worker_id))


def test_publisher_and_follower_keep_a_router_in_step() -> None:
    async def run() -> None:
        gcs, router, lost = FakeGCS(), FakeRouter(), []
        publisher = RegistryPublisher(reg(), [("prefill-0", "prefill", P0.address),
                                              ("decode-0", "decode", D0.address)], put=gcs.put)
        await publisher.start()
        follower = RegistryFollower(router, "pdserve", lambda r: None, lost.append,
                                    get=gcs.get)
        await follower.poll()
        assert router.decode == {"decode-0": D0.address} and router.prefill
        publisher.mark_down("decode-0")
        await asyncio.sleep(0.05)  # its publish runs in a task
        await follower.poll()
        await publisher.add_worker("decode-0", "decode", "127.0.0.1:6000")  # restarted
        await follower.poll()
        await publisher.drain("prefill-0", 1.0)
        await follower.poll()
        await asyncio.sleep(0.05)
        assert router.calls[2:] == [("down", "decode-0"), ("add", "decode-0", "127.0.0.1:6000"),
                                    ("drain", "prefill-0")]
        # a malformed registry is ignored: the last good table stays
        gcs.data["pdserve"] = b'{"version": 1, "workers": "x"}'
        await follower.poll()
        assert router.decode == {"decode-0": "127.0.0.1:6000"} and not lost
        await publisher.close(delete=gcs.delete)
        assert gcs.get("pdserve") is None
        await follower.poll()  # gone: nothing changes
        assert router.decode == {"decode-0": "127.0.0.1:6000"}
        await follower.stop()

    asyncio.run(run())


def test_follower_reports_a_changed_deployment() -> None:
    async def run() -> None:
        gcs, router, lost = FakeGCS(), FakeRouter(), []
        gcs.put("pdserve", encode(reg(D0, block_size=32)))
        follower = RegistryFollower(
            router, "pdserve", lambda r: registry.incompatibility(r, "tiny", 16, "disaggregated"),
            lost.append, get=gcs.get)
        await follower.poll()
        assert lost and "block_size" in lost[0] and not router.calls

    asyncio.run(run())


def test_router_only_needs_a_ray_address_and_the_cluster_secret(monkeypatch) -> None:
    from pdserve import cluster_secret
    from pdserve.launch.router_only import RouterOnly
    from pdserve.launch.settings import ServeSettings

    with pytest.raises(ValueError, match="router_only needs ray_address"):
        RouterOnly(ServeSettings(router_only=True))
    monkeypatch.delenv(cluster_secret.ENV, raising=False)
    monkeypatch.delenv(cluster_secret.ENV_FILE, raising=False)
    with pytest.raises(ValueError, match="no cluster secret"):
        RouterOnly(ServeSettings(router_only=True, ray_address="127.0.0.1:6379"))
