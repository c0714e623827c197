"""`pdserve up` as a user runs it: its own local Ray head and Redis; Ctrl-C stops all of it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil

from tests.e2e.harness import free_port

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def test_up_generate_chat_then_ctrl_c_stops_everything(tiny_llama_dir):
    tmp = tempfile.mkdtemp(prefix="pdray", dir="/tmp")
    http_port = free_port()
    env = {**os.environ, "RAY_TMPDIR": tmp, "PDSERVE_PORT": "0", "PDSERVE_METRICS_PORT": "0",
           "PDSERVE_HTTP_PORT": str(http_port), "PDSERVE_NUM_KV_BLOCKS": "128",
           "PDSERVE_MAX_MODEL_LEN": "512"}
    config = os.path.join(tmp, "pdserve.yaml")
    with open(config, "w") as f:  # the config-file layer, under the env and flag layers
        f.write("prefill_threads: 1\ndecode_threads: 1\nmax_num_seqs: 8\n")
    server = subprocess.Popen(
        [*PDSERVE, "up", "--model", str(tiny_llama_dir), "--config", config],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        address, log = wait_for_address(server, timeout=240)
        threading.Thread(target=server.stdout.read, daemon=True).start()  # keep draining
        children = psutil.Process(server.pid).children(recursive=True)
        assert any("redis-server" in " ".join(c.cmdline()) for c in children), log
        openai_url = f"http://127.0.0.1:{http_port}/v1"
        assert f"OpenAI API: {openai_url}" in log
        models = httpx.get(f"{openai_url}/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [tiny_llama_dir.name]
        reply = subprocess.run(
            [*PDSERVE, "generate", "Hello there", "--address", address, "--max-tokens", "5"],
            env=env, capture_output=True, text=True, timeout=120)
        assert reply.returncode == 0, reply.stderr
        assert reply.stdout.strip(), reply  # some text came back
        chat = subprocess.run(
            [*PDSERVE, "chat", "--address", address, "--max-tokens", "4"],
            input="Hi\nAgain\n", env=env, capture_output=True, text=True, timeout=120)
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout.count("> ") == 3  # two answered turns, then end of input
        bad = subprocess.run([*PDSERVE, "generate", "x", "--address", address,
                              "--temperature", "-1"], env=env, capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and "temperature" in bad.stderr
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=120) == 0
        gone = psutil.wait_procs([c for c in children if c.is_running()], timeout=30)[1]
        assert not gone, [c.cmdline()[:2] for c in gone]  # nothing it started outlives it
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def wait_for_address(server: subprocess.Popen, timeout: float) -> tuple[str, str]:
    end, lines = time.monotonic() + timeout, []
    while time.monotonic() < end:
        line = server.stdout.readline()
        if not line and server.poll() is not None:
            raise AssertionError("pdserve up exited:\n" + "".join(lines))
        lines.append(line)
        match = re.search(r"pdserve is serving \S+ on (127\.0\.0\.1:\d+)", line)
        if match:
            return match.group(1), "".join(lines)
    raise AssertionError("pdserve up did not come up:\n" + "".join(lines))

