"""`pdserve up` as a user runs it: its own local Ray head and Redis. SIGTERM (what Kubernetes
sends) or Ctrl-C drains it: the streams in flight finish, newcomers are turned away, readiness
fails; then it stops all of it and exits 0. A second signal stops at once."""

from __future__ import annotations

import contextlib
import json
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

import grpc
import httpx
import psutil
import pytest

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.certs import write_pki
from tests.e2e.harness import free_port

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def test_up_generate_chat_then_sigterm_drains_and_stops_everything(tiny_llama_dir):
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

        streams = [Stream(openai_url, tiny_llama_dir.name) for _ in range(8)]
        assert all(s.first.wait(60) for s in streams), [s.error for s in streams]
        server.send_signal(signal.SIGTERM)
        end = time.monotonic() + 10  # readiness fails at once
        while httpx.get(f"http://127.0.0.1:{http_port}/ready").status_code != 503:
            assert time.monotonic() < end, "still ready after SIGTERM"
            time.sleep(0.05)
        late = httpx.post(f"{openai_url}/completions", timeout=30,
                          json={"model": tiny_llama_dir.name, "prompt": "x", "max_tokens": 2})
        assert late.status_code == 503, late.text
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            request = pdserve_pb2.GenerateRequest(prompt="x")
            list(pdserve_pb2_grpc.InferenceStub(channel).Generate(request, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        in_flight = sum(s.is_alive() for s in streams)  # while the late ones were refused
        for s in streams:
            s.join(120)
        assert [(s.finish_reason, s.num_tokens, s.error) for s in streams] == [
            ("length", Stream.MAX_TOKENS, None)] * 8
        assert in_flight > 0, "every stream had ended before the late requests: no drain seen"
        assert server.wait(timeout=60) == 0
        gone = psutil.wait_procs([c for c in children if c.is_running()], timeout=30)[1]
        assert not gone, [c.cmdline()[:2] for c in gone]  # nothing it started outlives it
    finally:
        kill_everything(server)
        shutil.rmtree(tmp, ignore_errors=True)


class Stream(threading.Thread):
    """One streamed completion over the OpenAI API, as long as the test model allows."""

    MAX_TOKENS = 480  # of max_model_len 512

    def __init__(self, base_url: str, model: str, max_tokens: int = MAX_TOKENS,
                 **client) -> None:
        super().__init__(daemon=True)
        self.url, self.client = f"{base_url}/completions", client
        self.body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                     "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True}}
        self.first = threading.Event()  # the first chunk came
        self.finish_reason = self.num_tokens = self.error = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.Client(timeout=120, **self.client) as client, client.stream(
                    "POST", self.url, json=self.body) as reply:
                reply.raise_for_status()
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: "):])
                    self.first.set()
                    for choice in chunk["choices"]:
                        self.finish_reason = choice["finish_reason"] or self.finish_reason
                    if chunk.get("usage"):
                        self.num_tokens = chunk["usage"]["completion_tokens"]
        except Exception as exc:  # the test reads it
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.first.set()


def kill_everything(server: subprocess.Popen) -> None:
    """A failed test's clean-up: `pdserve up` and every process it started (some, as the
    bundled Redis, in a process group of their own)."""
    if server.poll() is not None:
        return
    started = psutil.Process(server.pid).children(recursive=True)
    os.killpg(server.pid, signal.SIGKILL)
    for process in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


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
           "PDSERVE_MAX_MODEL_LEN": "1024", "PDSERVE_TLS_CERT": pki.server_cert,
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
        stream = Stream(f"https://127.0.0.1:{http_port}/v1", tiny_llama_dir.name,
                        max_tokens=1000, headers=headers, verify=ca)  # seconds of tokens
        assert stream.first.wait(60) and stream.error is None, stream.error
        server.send_signal(signal.SIGINT)  # Ctrl-C: drains ...
        time.sleep(0.2)
        server.send_signal(signal.SIGINT)  # ... and a second one stops at once
        assert server.wait(timeout=60) == 0
        stream.join(30)
        assert stream.finish_reason is None and stream.num_tokens is None  # cut short
    finally:
        kill_everything(server)
        shutil.rmtree(tmp, ignore_errors=True)
