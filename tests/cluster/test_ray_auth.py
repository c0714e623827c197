"""Joining a Ray cluster that runs token authentication, as `pdserve up --ray-address` does.

A head started by `ray start --head` with RAY_AUTH_MODE=token (what Ray does by itself where
~/.ray/auth_token exists), then `start_ray(address)` in a fresh process with no RAY_AUTH_MODE:
with the token at hand it joins; without one it says which file it needs. (Clusters without
authentication are what every other Ray test here joins.) Everything runs under a temp dir and
a token file of the test's own (RAY_AUTH_TOKEN_PATH); only the head this test started is
stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

RAY = Path(sys.executable).with_name("ray")
JOIN = """
import sys, ray
from pdserve.launch.ray_runtime import start_ray
start_ray(sys.argv[1], {}, None, None)
print("cpus", ray.cluster_resources().get("CPU"))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_join_sends_the_token_a_token_cluster_needs():
    with tempfile.TemporaryDirectory(prefix="pdauth", dir="/tmp") as tmp:
        token = Path(tmp, "token")
        token.write_text("pdserve-test-token-0123456789abcdef")
        env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_AUTH_TOKEN_PATH": str(token)}
        env.pop("RAY_AUTH_MODE", None)
        address = f"127.0.0.1:{free_port()}"
        before = set(psutil.Process().children(recursive=True))
        subprocess.run(
            [str(RAY), "start", "--head", "--port", address.split(":")[1], "--node-ip-address",
             "127.0.0.1", "--temp-dir", f"{tmp}/r", "--num-cpus", "1",
             "--include-dashboard", "false", "--disable-usage-stats"],
            env={**env, "RAY_AUTH_MODE": "token"}, check=True, capture_output=True, timeout=60)
        try:
            joined = subprocess.run([sys.executable, "-c", JOIN, address], env=env,
                                    capture_output=True, text=True, timeout=60)
            assert joined.returncode == 0, joined.stderr[-2000:]
            assert "cpus 1.0" in joined.stdout
            tokenless = {**env, "HOME": tmp}
            tokenless.pop("RAY_AUTH_TOKEN_PATH")
            refused = subprocess.run([sys.executable, "-c", JOIN, address], env=tokenless,
                                     capture_output=True, text=True, timeout=60)
            assert refused.returncode != 0
            assert "requires its auth token" in refused.stderr, refused.stderr[-2000:]
        finally:
            started = [p for p in psutil.process_iter(["cmdline"])
                       if any(f"{tmp}/r" in part for part in p.info["cmdline"] or ())]
            for proc in {*started, *(set(psutil.Process().children(recursive=True)) - before)}:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.send_signal(signal.SIGKILL)
