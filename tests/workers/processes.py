"""Start worker processes (tests.workers.host) and talk to them in JSON lines."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import socket
import subprocess
import sys
from pathlib import Path

from pdserve.engine.sampling_params import SamplingParams
from tests.workers.pd import SECRET

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Host:
    """One worker process; `call` sends a command and returns its one-line JSON answer."""

    def __init__(self, config: dict) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **SECRET.to_env())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.workers.host"], cwd=REPO, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        self.send(config)

    def send(self, body: dict) -> None:
        self.proc.stdin.write(json.dumps(body) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 120.0) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"worker said nothing in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError(f"worker exited with {self.proc.wait(timeout=10)}")
        return json.loads(line)

    def call(self, op: str, timeout: float = 120.0, **body) -> dict:
        self.send({"op": op, **body})
        return self.read(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, TimeoutError, EOFError, ValueError):
                self.call("close", timeout=30)
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_prefill(model_dir, **extra) -> Host:
    return wait_ready(spawn_prefill(model_dir, **extra))


def spawn_prefill(model_dir, **extra) -> Host:
    """A prefill worker process, still starting (`wait_ready` before its first call): a
    test can start one while it uses another."""
    port = free_port()
    host = Host({"role": "prefill", "model_dir": str(model_dir), "identity_port": port, **extra})
    host.source = ["127.0.0.1", port, 0]  # the identity its descriptors name as the source
    return host


def wait_ready(prefill: Host) -> Host:
    assert prefill.read().get("ready"), "prefill worker did not start"
    return prefill


def start_decode_group(model_dir, tp_size: int, **extra) -> list[Host]:
    port = free_port()
    hosts = [
        Host({"role": "decode", "rank": r, "tp_size": tp_size, "tp_port": port,
              "model_dir": str(model_dir), **extra})
        for r in range(tp_size)
    ]
    assert hosts[0].read().get("ready"), "decode rank 0 did not start"
    return hosts


def params_json(params: SamplingParams) -> dict:
    return dataclasses.asdict(params)
