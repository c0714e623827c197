"""The CUDA path's process groups, checked on CPU with the device abstracted.

What a GPU run would exercise, each piece here without one: the worker spec's device reaches
the KV connector and listeners (so a CUDA worker's data groups are NCCL), the decode TP group
gets an NCCL side for device tensors while CPU tensors (plan messages, votes) stay on gloo,
and a KV pair or TP group whose ranks share one GPU is refused before NCCL is ever asked.
The identity exchanges run over real gloo groups (threads of this process, a HashStore);
only the identities (`identity=`) and the NCCL constructor (`nccl_group`) are fakes.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pdserve.cluster_secret import ENV as SECRET_ENV
from pdserve.decode_worker import actor as decode_actor
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.plan_broadcast import publish, receive
from pdserve.kvtransfer import rendezvous
from pdserve.kvtransfer.device_groups import (
    IDENTITY_BYTES,
    DeviceIdentity,
    check_transport_device,
    collective_backend,
    local_identity,
    shared_gpu,
    shared_gpu_reason,
)
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.rendezvous import GlooConnector, GlooListener, make_groups
from pdserve.kvtransfer.sender import KVSender
from pdserve.prefill_worker import service as prefill_service
from pdserve.worker_spec import WorkerSpec
from tests.kvtransfer.kvdata import SECRET, TINY, endpoints, full_caches, zero_caches

CUDA = torch.device("cuda")  # only a name here: nothing below touches CUDA
TIMEOUT = timedelta(seconds=5)
GPU_A = DeviceIdentity("cuda", "11111111-aaaa-bbbb-cccc-000000000001", "node-a")
GPU_B = DeviceIdentity("cuda", "11111111-aaaa-bbbb-cccc-000000000002", "node-b")


def spec(device: str) -> WorkerSpec:
    return WorkerSpec("w0", "/nonexistent/model", "tiny", device=device)


def on_ranks(size: int, fn: Any) -> list[Any]:
    """fn(store, rank) on `size` threads at once; each rank's result or raised exception."""
    store, out = dist.HashStore(), [None] * size

    def run(rank: int) -> None:
        try:
            out[rank] = fn(store, rank)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


# ---- which backend a device's tensors take ----

def test_cpu_tensors_take_gloo_and_cuda_tensors_nccl() -> None:
    assert collective_backend("cpu") == collective_backend(torch.device("cpu")) == "gloo"
    assert collective_backend("cuda") == collective_backend("cuda:1") == "nccl"
    with pytest.raises(ValueError, match="--device cpu or cuda"):
        collective_backend("meta")


def test_a_transport_refuses_kv_of_another_device_kind() -> None:
    check_transport_device(None, CUDA, "x")  # in-process: carries anything
    check_transport_device(torch.device("cuda"), torch.device("cuda:0"), "x")  # kind only
    with pytest.raises(ValueError, match="device='cpu'"):
        check_transport_device(CUDA, torch.device("cpu"), "KVSender")


def test_sender_and_receiver_refuse_a_transport_for_another_device() -> None:
    connector = GlooConnector(endpoints(1, 1)[0], device="cuda", secret=SECRET)
    with pytest.raises(ValueError, match="KVSender.*built for cuda"):
        KVSender(TINY, connector, 1, full_caches(TINY, 4, seed=1))
    listener = GlooListener("127.0.0.1", device="cuda", connect_timeout_s=2, secret=SECRET)
    try:
        with pytest.raises(ValueError, match="KVReceiver.*built for cuda"):
            KVReceiver(TINY, listener, 1, zero_caches(TINY, 4, TINY.num_kv_heads))
    finally:
        listener.close()


def test_connector_and_listener_refuse_an_unsupported_device() -> None:
    with pytest.raises(ValueError, match="--device"):
        GlooConnector(endpoints(1, 1)[0], device="meta", secret=SECRET)
    with pytest.raises(ValueError, match="--device"):
        GlooListener("127.0.0.1", device="meta", secret=SECRET)


# ---- the worker spec's device reaches the KV transports ----

@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_prefill_service_connects_on_the_spec_device(monkeypatch, device: str) -> None:
    made: list[Any] = []

    class FakeWorker:
        def __init__(self, config, transport, model_name, publisher) -> None:
            made.append(transport)

        def close(self) -> None:
            pass

    monkeypatch.setattr(prefill_service, "PrefillWorker", FakeWorker)
    monkeypatch.setattr(WorkerSpec, "engine_config", lambda self: None)
    service = prefill_service.PrefillService(spec(device), SECRET)
    try:
        (connector,) = made
        assert isinstance(connector, GlooConnector)
        assert connector.device == torch.device(device)
        assert connector.source == endpoints(service.port, 1)[0]
        assert collective_backend(connector.device) == {"cpu": "gloo", "cuda": "nccl"}[device]
    finally:
        service.stop()


def test_decode_ranks_listen_and_form_tp_on_the_spec_device(monkeypatch) -> None:
    """Both ranks of a TP=2 CUDA spec: listeners on CUDA, make_tp told the device."""
    monkeypatch.setenv(SECRET_ENV, SECRET.value.decode())
    tp_calls: list[tuple] = []

    def fake_make_tp(store, host, rank, size, device, timeout, expert_parallel=False):
        tp_calls.append((rank, size, device))
        return TensorParallel(rank, size, group=object())

    monkeypatch.setattr(decode_actor, "make_tp", fake_make_tp)
    monkeypatch.setattr(WorkerSpec, "engine_config", lambda self: None)
    monkeypatch.setattr(decode_actor, "start_decode_rank", lambda *a, **k: None)
    monkeypatch.setattr(decode_actor, "DecodeService",
                        lambda *a, **k: SimpleNamespace(address="x:1", stop=lambda: None))
    ranks = [decode_actor.DecodeRankActor(spec("cuda").to_dict(), r, 2) for r in (0, 1)]
    try:
        meet = ranks[0].rendezvous()
        assert ranks[0].start(meet) == "x:1"
        assert ranks[1].start(meet) is None
        assert sorted(tp_calls) == [(0, 2, "cuda"), (1, 2, "cuda")]
        assert [r.listener.device for r in ranks] == [CUDA, CUDA]
        assert ranks[1].listener.endpoint == endpoints(meet["kv_port"], 2)[1]
    finally:
        for r in reversed(ranks):
            r.stop()


# ---- device identities ----

def test_identity_round_trips_as_fixed_bytes() -> None:
    long_host = DeviceIdentity("cuda", GPU_A.uuid, "h" * 1000)
    for ident in (GPU_A, DeviceIdentity("cpu", "", "node"), long_host):
        raw = ident.encode()
        assert len(raw) == IDENTITY_BYTES
        back = DeviceIdentity.decode(raw)
        assert (back.kind, back.uuid) == (ident.kind, ident.uuid)
        assert ident.host.startswith(back.host)
    for garbage in (b"", b"\0" * IDENTITY_BYTES, b"cuda\nonly-two".ljust(IDENTITY_BYTES, b"\0"),
                    GPU_A.encode()[:-1]):
        with pytest.raises(ValueError):
            DeviceIdentity.decode(garbage)


def test_local_identity_reads_the_gpu_uuid() -> None:
    props = {0: SimpleNamespace(uuid="uuid-0"), 3: SimpleNamespace(uuid="uuid-3"),
             4: SimpleNamespace(uuid="", pci_domain_id=0, pci_bus_id=65, pci_device_id=0)}
    cuda = SimpleNamespace(current_device=lambda: 0, get_device_properties=props.__getitem__)
    assert local_identity(torch.device("cpu"), cuda).kind == "cpu"
    assert local_identity(torch.device("cuda:3"), cuda).uuid == "uuid-3"
    assert local_identity(torch.device("cuda"), cuda).uuid == "uuid-0"  # the current device
    assert local_identity(torch.device("cuda:4"), cuda).uuid.startswith("pci-0:65:0@")


def test_shared_gpu_names_the_ranks_on_one_gpu() -> None:
    cpu = DeviceIdentity("cpu", "", "node-a")
    unknown = DeviceIdentity("cuda", "", "node-a")
    assert shared_gpu([GPU_A, GPU_B]) is None
    assert shared_gpu([cpu, cpu]) is None and shared_gpu([unknown, unknown]) is None
    assert shared_gpu([GPU_A, GPU_A]) == (0, 1)
    assert shared_gpu([GPU_A, GPU_B, DeviceIdentity("cuda", GPU_A.uuid, "node-c")]) == (0, 2)
    why = shared_gpu_reason([GPU_A, GPU_A], "KV pair", "give them different GPUs")
    assert "Duplicate GPU detected" in why and GPU_A.uuid in why
    assert why.endswith("give them different GPUs")
    assert shared_gpu_reason([GPU_A, GPU_B], "KV pair", "fix") is None


# ---- the KV pair's groups ----

def test_cpu_pair_makes_two_gloo_groups_and_trades_no_identity(monkeypatch) -> None:
    monkeypatch.setattr(rendezvous, "nccl_group", None)  # would fail if called

    def pair(store, rank):
        return make_groups(store, "p", rank, "127.0.0.1", torch.device("cpu"), TIMEOUT,
                           identity=lambda device: pytest.fail("CPU trades no identity"))

    for control, data in on_ranks(2, pair):
        assert control.name() == data.name() == "gloo"


def test_cuda_pair_on_two_gpus_gets_an_nccl_data_group(monkeypatch) -> None:
    made: list[tuple[int, int]] = []
    monkeypatch.setattr(rendezvous, "nccl_group",
                        lambda store, rank, size, timeout: made.append((rank, size)) or "nccl")

    def pair(store, rank):
        return make_groups(store, "p", rank, "127.0.0.1", CUDA, TIMEOUT,
                           identity=lambda device: (GPU_A, GPU_B)[rank])

    results = on_ranks(2, pair)
    assert [(c.name(), d) for c, d in results] == [("gloo", "nccl"), ("gloo", "nccl")]
    assert sorted(made) == [(0, 2), (1, 2)]


def test_cuda_pair_on_one_gpu_is_refused_on_both_ends(monkeypatch) -> None:
    monkeypatch.setattr(rendezvous, "nccl_group", None)  # never reached

    def pair(store, rank):
        return make_groups(store, "p", rank, "127.0.0.1", CUDA, TIMEOUT,
                           identity=lambda device: GPU_A)

    for error in on_ranks(2, pair):
        assert isinstance(error, TransferError) and error.code == ErrorCode.DEVICE_CONFLICT
        assert "Duplicate GPU" in str(error) and "different GPUs" in str(error)


def test_cuda_end_facing_a_cpu_end_fails_within_the_timeout() -> None:
    def pair(store, rank):
        device = CUDA if rank == 0 else torch.device("cpu")
        return make_groups(store, "p", rank, "127.0.0.1", device, timedelta(seconds=0.5),
                           identity=lambda device: GPU_A)

    cuda_end, cpu_end = on_ranks(2, pair)
    assert isinstance(cuda_end, TransferError) and cuda_end.code == ErrorCode.PEER_LOST
    assert "same --device" in str(cuda_end)
    assert isinstance(cpu_end, RuntimeError)


# ---- the decode TP group ----

def test_cpu_tp_is_one_gloo_group() -> None:
    def rank_tp(store, rank):
        return decode_actor.make_tp(store, "127.0.0.1", rank, 2, "cpu", TIMEOUT,
                                    identity=lambda device: pytest.fail("no identity on CPU"))

    for rank, tp in enumerate(on_ranks(2, rank_tp)):
        assert (tp.rank, tp.size, tp.group.name(), tp.device_group) == (rank, 2, "gloo", None)


def test_cuda_tp_adds_nccl_for_device_tensors(monkeypatch) -> None:
    monkeypatch.setattr(decode_actor, "nccl_group",
                        lambda store, rank, size, timeout: f"nccl-{rank}-of-{size}")

    def rank_tp(store, rank):
        return decode_actor.make_tp(store, "127.0.0.1", rank, 2, "cuda", TIMEOUT, True,
                                    identity=lambda device: (GPU_A, GPU_B)[rank])

    for rank, tp in enumerate(on_ranks(2, rank_tp)):
        assert (tp.group.name(), tp.device_group, tp.expert_parallel) == (
            "gloo", f"nccl-{rank}-of-2", True)


def test_cuda_tp_on_one_gpu_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(decode_actor, "nccl_group", None)

    def rank_tp(store, rank):
        return decode_actor.make_tp(store, "127.0.0.1", rank, 2, "cuda", TIMEOUT,
                                    identity=lambda device: GPU_A)

    for error in on_ranks(2, rank_tp):
        assert isinstance(error, ValueError) and "its own GPU" in str(error)


class RecordingGroup:
    """A process group that records each collective and completes it at once."""

    def __init__(self, name: str, replay: list[torch.Tensor] | None = None) -> None:
        self.name, self.calls, self.replay = name, [], replay

    def _done(self, what: str, tensor: torch.Tensor) -> Any:
        self.calls.append((what, tensor.device.type, tensor.clone()))
        return SimpleNamespace(wait=lambda *a: True)

    def allreduce(self, tensors):
        return self._done("allreduce", tensors[0])

    def allgather(self, outputs, inputs):
        return self._done("allgather", inputs[0])

    def broadcast(self, x, root):
        if self.replay is not None:  # a follower: the root's tensor arrives
            x.copy_(self.replay.pop(0))
        return self._done("broadcast", x)


def test_tp_model_collectives_take_the_device_group_and_host_ones_gloo() -> None:
    gloo, nccl = RecordingGroup("gloo"), RecordingGroup("nccl")
    tp = TensorParallel(0, 2, gloo, device_group=nccl)
    device_x = torch.empty(2, 3, device="meta")  # a non-CPU tensor, as a CUDA one would be
    tp.all_reduce(device_x)
    assert tp.all_gather_last(device_x).shape == (2, 6)
    tp.all_reduce_host(torch.zeros(3, dtype=torch.int64))  # admission votes
    tp.broadcast(torch.zeros(1, dtype=torch.int64))  # a plan message's length
    assert [(c[0], c[1]) for c in nccl.calls] == [("allreduce", "meta"), ("allgather", "meta")]
    assert [(c[0], c[1]) for c in gloo.calls] == [("allreduce", "cpu"), ("broadcast", "cpu")]
    cpu_only = RecordingGroup("gloo")  # CPU: the one gloo group carries everything
    tp = TensorParallel(0, 2, cpu_only)
    tp.all_reduce(torch.zeros(2))
    tp.all_reduce_host(torch.zeros(2))
    assert [c[0] for c in cpu_only.calls] == ["allreduce", "allreduce"]


def test_plan_messages_ride_the_gloo_group_on_cuda() -> None:
    gloo, nccl = RecordingGroup("gloo"), RecordingGroup("nccl")
    publish(TensorParallel(0, 2, gloo, device_group=nccl), "plan", {"requests": [1, 2]})
    assert nccl.calls == [] and [(c[0], c[1]) for c in gloo.calls] == [("broadcast", "cpu")] * 2
    follower_gloo = RecordingGroup("gloo", replay=[c[2] for c in gloo.calls])
    follower_nccl = RecordingGroup("nccl")
    tp = TensorParallel(1, 2, follower_gloo, device_group=follower_nccl)
    assert receive(tp) == ("plan", {"requests": [1, 2]})
    assert follower_nccl.calls == [] and len(follower_gloo.calls) == 2
