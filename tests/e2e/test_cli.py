"""`pdserve up` as a user runs it: its own local Ray head and Redis; Ctrl-C stops all of it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil

from tests.certs import write_pki
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



def test_up_with_tls_and_a_token_file_serves_only_verified_clients(tiny_llama_dir, tmp_path):
    pki = write_pki(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text("# one per line\nalpha-token\nbeta-token\n")
    tmp = tempfile.mkdtemp(prefix="pdray", dir="/tmp")
    http_port = free_port()
    env = {**os.environ, "RAY_TMPDIR": tmp, "PDSERVE_NUM_KV_BLOCKS": "128",
           "PDSERVE_MAX_MODEL_LEN": "512", "PDSERVE_TLS_CERT": pki.server_cert,
           "PDSERVE_TLS_KEY": pki.server_key, "PDSERVE_API_TOKEN_FILE": str(tokens)}
    server = subprocess.Popen(
        [*PDSERVE, "up", "--model", str(tiny_llama_dir), "--port", "0", "--metrics-port", "0",
         "--http-port", str(http_port), "--prefill-threads", "1", "--decode-threads", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        address, log = wait_for_address(server, timeout=240)
        threading.Thread(target=server.stdout.read, daemon=True).start()
        assert "(grpcs: TLS)" in log and f"https://127.0.0.1:{http_port}/v1" in log, log
        assert "alpha-token" not in log and "PDSERVE_CLUSTER_SECRET" not in log

        def generate(*flags: str) -> subprocess.CompletedProcess:
            client_env = {k: v for k, v in env.items() if not k.startswith("PDSERVE_")}
            return subprocess.run([*PDSERVE, "generate", "Hello", "--address", address,
                                   "--max-tokens", "4", *flags], env=client_env,
                                  capture_output=True, text=True, timeout=120)

        token_file = tmp_path / "mine"
        token_file.write_text("beta-token\n")
        ok = generate("--tls-ca", pki.ca, "--api-token-file", str(token_file))
        assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
        assert generate("--tls-ca", pki.ca, "--api-token", "wrong").returncode != 0
        assert generate("--api-token-file", str(token_file)).returncode != 0  # plaintext
        url = f"https://127.0.0.1:{http_port}/v1/models"
        headers, ca = {"Authorization": "Bearer alpha-token"}, ssl.create_default_context(
            cafile=pki.ca)
        models = httpx.get(url, headers=headers, verify=ca, timeout=30).json()["data"]
        assert [m["id"] for m in models] == [tiny_llama_dir.name]
        assert httpx.get(url, verify=ca, timeout=30).status_code == 401
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=120) == 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
