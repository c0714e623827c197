"""A prefill process pushes KV to this (decode) process over real gloo; then we kill it."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.kvtransfer import ErrorCode, GlooListener, KVLayout, KVReceiver, TransferError
from tests.kvtransfer.kvdata import SECRET, assert_landed, descriptor, full_caches, zero_caches

REPO = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout("tiny-llama", "float32", block_size=16, num_layers=4, num_kv_heads=4,
                  head_dim=32)
SOURCE = ["127.0.0.1", 1, 0]  # identity only: the prefill side hosts no store
SEED, SRC_BLOCKS = 11, 24


def start_peer(config: dict) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **SECRET.to_env())
    proc = subprocess.Popen([sys.executable, "-m", "tests.kvtransfer.peer_sender"], cwd=REPO,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(config) + "\n")
    proc.stdin.close()
    return proc


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"peer printed nothing in {timeout} s")
    return proc.stdout.readline().strip()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def config(transfers, mode: str) -> dict:
    return {"layout": dataclasses.asdict(LAYOUT), "source": SOURCE, "seed": SEED,
            "num_blocks": SRC_BLOCKS, "mode": mode, "stall_s": 30.0,
            "transfers": [[d.encode().decode(), src] for d, src in transfers]}


def test_two_processes_move_exact_bytes_with_resharding() -> None:
    """Prefill TP=1 in another process -> decode TP=2 here (two ranks, one shared store)."""
    rank0 = GlooListener("127.0.0.1", rank=0, secret=SECRET)
    rank1 = GlooListener("127.0.0.1", rank=1, port=rank0.endpoint.port, host_store=False,
                         secret=SECRET)
    dests = [zero_caches(LAYOUT, 32, 2), zero_caches(LAYOUT, 32, 2)]
    receivers = [KVReceiver(LAYOUT, lst, 2, c) for lst, c in zip((rank0, rank1), dests)]
    requests = [(list(range(0, 8)), list(range(24, 32))), ([8, 9, 10], [3, 1, 2]),
                ([11], [17]), (list(range(12, 24)), list(range(4, 16)))]
    descs = [descriptor(LAYOUT, [rank0.endpoint.__class__(*SOURCE)],
                        [rank0.endpoint, rank1.endpoint], dst, ttl=60) for _, dst in requests]
    for d in descs:
        for r in receivers:
            r.expect(d)
    proc = start_peer(config([(d, src) for d, (src, _) in zip(descs, requests)], "all"))
    try:
        assert read_line(proc, 60) == "done"
        for r in receivers:
            for d in descs:
                assert r.wait(d.transfer_id, timeout=30)
        assert proc.wait(timeout=30) == 0
    finally:
        stop(proc)
        for r in reversed(receivers):  # rank 0 hosts the store the others poll: last
            r.close()
    source = full_caches(LAYOUT, SRC_BLOCKS, SEED)
    for j, caches in enumerate(dests):
        for src, dst in requests:
            assert_landed(source, caches, src, dst, 2 * j, 2 * j + 2)


def test_sender_killed_mid_push_fails_the_receiver_fast() -> None:
    listener = GlooListener("127.0.0.1", secret=SECRET)
    dest = zero_caches(LAYOUT, 32, 4)
    rx = KVReceiver(LAYOUT, listener, 1, dest)
    desc = descriptor(LAYOUT, [listener.endpoint.__class__(*SOURCE)], [listener.endpoint],
                      list(range(8)), ttl=30)
    rx.expect(desc)
    proc = start_peer(config([(desc, list(range(8)))], "stall"))
    try:
        assert read_line(proc, 60) == "stalled"  # 3 of 4 layers pushed, the 4th never comes
        killed = time.time()
        proc.kill()  # SIGKILL: no goodbye on any socket
        with pytest.raises(TransferError) as e:
            rx.wait(desc.transfer_id)
        elapsed = time.time() - killed
    finally:
        stop(proc)
        rx.close()
    assert e.value.code is ErrorCode.PEER_LOST, e.value
    assert elapsed < 3.0, f"noticed the dead sender after {elapsed:.2f} s (deadline was 30 s)"
    print(f"dead sender noticed after {elapsed * 1000:.0f} ms")
