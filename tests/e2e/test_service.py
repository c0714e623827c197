"""The whole service over real gRPC, a real Redis server and real Ray (two nodes).

The package's shared service (tests/e2e/conftest.py): 1 prefill worker on the "prefill" node,
1 decode worker on the "decode" node, the router and a bundled redis-server, serving a tiny
random Llama. Every test runs twice: on that service's gRPC front (the router's own HTTP/2)
and on a service alike but for its front, grpc.aio's server (`--grpc-server grpcio`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis

from pdserve import redis_keys
from pdserve.client import AsyncClient, Client, PdserveError
from pdserve.engine.block_hash import hash_blocks
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2, raw_pb2
from pdserve.router.metrics_text import sample_value
from tests.e2e.harness import (
    MAX_INFLIGHT,
    MAX_QUEUED,
    health,
    raw_generate,
    running,
    stats,
    tiny_settings,
    wait_until,
)
from tests.integration.hf_reference import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["h2", "grpcio"])
def service(request, ray_cluster, tiny_llama_dir):
    """The package's shared service (the router's own HTTP/2 front), then one alike but for
    its gRPC front: grpc.aio's server (`--grpc-server grpcio`)."""
    if request.param == "h2":
        yield request.getfixturevalue("tiny_service")
        return
    settings = tiny_settings(tiny_llama_dir, ray_cluster.address, grpc_server="grpcio",
                             max_inflight_requests=MAX_INFLIGHT, max_queued_requests=MAX_QUEUED,
                             redis_namespace="e2e-grpcio")
    with running(settings) as service:
        yield service



def all_blocks_free(address: str) -> bool:
    return all(w.num_used_blocks == 0 and w.up for w in stats(address).workers)


def test_greedy_matches_offline_engine(service, offline):
    prompts = [list(p) for p in mixed_prompts(offline.config.model.vocab_size, seed=11)]
    prompts = [p[:400] for p in prompts]
    expected = [list(o.token_ids) for o in offline.generate(prompts, GREEDY)]
    cached_before = prefill_cached_blocks(service.address)
    with Client(service.address, timeout=120) as client, ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: client.complete(p, sampling=GREEDY), prompts))
    assert [list(c.token_ids) for c in got] == expected
    assert all(c.finish_reason == "length" and c.usage.completion_tokens == 24 for c in got)
    text = offline.tokenizer.decode(expected[0])
    assert got[0].text == text
    assert wait_until(lambda: all_blocks_free(service.address), 5, "every block freed")
    # disaggregated for real: the prompts were prefilled (and cached) on the prefill worker;
    # their blocks are new to it (random tokens), and its pool has room for them beside what
    # earlier tests left (nothing is evicted)
    distinct_blocks = len({h for p in prompts for h in hash_blocks(p, 16)})
    assert wait_until(lambda: prefill_cached_blocks(service.address)
                      == cached_before + distinct_blocks,
                      5, f"the prefill worker caches all {distinct_blocks} prompt blocks")


def prefill_cached_blocks(address: str) -> int:
    return next(w for w in stats(address).workers if w.role == "prefill").num_cached_blocks


def test_32_concurrent_streams_complete(service):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)

    async def run():
        async with AsyncClient(service.address, timeout=120) as client:
            return await asyncio.gather(*[
                client.complete([10 + i, 20 + i, 30 + i] * (i + 1), sampling=params)
                for i in range(32)
            ])

    done = asyncio.run(run())
    assert [c.usage.completion_tokens for c in done] == [16] * 32
    assert {c.finish_reason for c in done} == {"length"}
    assert len({c.request_id for c in done}) == 32


def test_second_turn_of_a_session_reuses_the_first(service):
    session = "s-two-turns"
    turn1 = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    with Client(service.address, timeout=120) as client:
        first = client.complete(messages=turn1, session_id=session, sampling=GREEDY)
        turn2 = turn1 + [{"role": "assistant", "content": first.text},
                         {"role": "user", "content": "And two more?"}]
        second = client.complete(messages=turn2, session_id=session, sampling=GREEDY)
    # The first turn's prompt and most of its reply are served from the decode worker's cache
    history = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.cached_tokens > first.usage.prompt_tokens
    assert second.usage.cached_tokens >= history - 2 * 16 - 2
    settings = service.service.settings
    r = redis.Redis.from_url(service.service.redis.url)
    key = redis_keys.session_key(settings.redis_namespace,  # one tenant: the API has no token
                                 redis_keys.scoped_session_id(redis_keys.PUBLIC_TENANT, session))
    stored = r.hgetall(key)
    assert stored[b"decode_worker"] == b"decode-0"
    assert r.ttl(key) > 0
    r.close()


def test_session_is_stored_before_the_last_message(service, monkeypatch):
    """A client that sends its next turn the moment a reply ends finds the session: the
    router stores it before the final message goes out, however slow Redis is."""
    store = service.router.store
    put_session = store.put_session

    async def slow_put_session(*args):
        await asyncio.sleep(0.5)
        await put_session(*args)

    monkeypatch.setattr(store, "put_session", slow_put_session)
    with Client(service.address, timeout=120) as client:
        client.complete([5, 6, 7, 8], session_id="s-stored-first", sampling=GREEDY)
    r = redis.Redis.from_url(service.service.redis.url)
    key = redis_keys.session_key(service.service.settings.redis_namespace,
                                 redis_keys.scoped_session_id(redis_keys.PUBLIC_TENANT,
                                                              "s-stored-first"))
    assert r.hget(key, b"decode_worker") == b"decode-0"
    r.close()


BAD_SAMPLING = [
    ("temperature", {"temperature": -0.5}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": 1.5}),
    ("seed", {"seed": -1}),
    ("logprobs", {"logprobs": 21}),
    ("max_tokens", {"max_tokens": -3}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 10_000}),
    ("stop_token_ids", {"stop_token_ids": [10**7]}),
    ("stop", {"stop": [""]}),
]


@pytest.mark.parametrize("field,sampling", BAD_SAMPLING, ids=[f"{f}-{i}" for i, (f, _) in
                                                              enumerate(BAD_SAMPLING)])
def test_each_out_of_range_sampling_field_is_named(service, field, sampling):
    request = pdserve_pb2.GenerateRequest(prompt="hello",
                                          sampling=pdserve_pb2.SamplingParams(**sampling))
    error = call_error(service.address, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in error.details()


@pytest.mark.parametrize("field,request_fields", [
    ("prompt", {"prompt": ""}),
    ("prompt", {}),
    ("prompt", {"prompt": "x " * 600}),
    ("prompt_token_ids", {"prompt_token_ids": [1, 2, 10**7]}),
    ("messages[0].role", {"messages": [pdserve_pb2.ChatMessage(content="hi")]}),
    ("model", {"prompt": "hi", "model": "gpt-17"}),
    ("request_id", {"prompt": "hi", "request_id": "x" * 300}),
])
def test_bad_requests_are_refused_naming_the_field(service, field, request_fields):
    request = pdserve_pb2.GenerateRequest(**request_fields)
    error = call_error(service.address, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.details(), error.details()


def test_invalid_utf8_is_invalid_argument_naming_the_field(service):
    for raw, field in [
        (raw_pb2.RawGenerateRequest(prompt=b"caf\xc3"), "prompt"),
        (raw_pb2.RawGenerateRequest(prompt=b"ok", session_id=b"\xff"), "session_id"),
        (raw_pb2.RawGenerateRequest(prompt=b"ok", sampling=raw_pb2.RawSamplingParams(
            stop=[b"fine", b"\xfe\xff"])), "sampling.stop[1]"),
    ]:
        error = raw_generate(service.address, raw.SerializeToString())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith(field), error.details()


def test_server_stays_healthy_after_bad_input(service):
    for _ in range(20):
        call_error(service.address, pdserve_pb2.GenerateRequest(prompt=""))
    assert health(service.address) == "SERVING"
    with Client(service.address, timeout=60) as client:
        assert client.complete("hello", sampling=GREEDY).usage.completion_tokens == 24


def test_full_queue_is_resource_exhausted(service):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    total = MAX_INFLIGHT + MAX_QUEUED + 10

    async def run():
        async with AsyncClient(service.address, timeout=120) as client:
            async def one(i):
                try:
                    async for _ in client.generate([5, 6, 7, i], sampling=params):
                        pass
                    return "ok"
                except PdserveError as exc:
                    return exc.code.name
            tasks = [asyncio.create_task(one(i)) for i in range(total)]
            while sum(t.done() for t in tasks) < total - MAX_INFLIGHT - MAX_QUEUED:
                await asyncio.sleep(0.01)
            refused = [t.result() for t in tasks if t.done()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return refused

    refused = asyncio.run(run())
    assert refused.count("RESOURCE_EXHAUSTED") >= total - MAX_INFLIGHT - MAX_QUEUED
    assert wait_until(lambda: all_blocks_free(service.address), 10, "every block freed")


def test_cancel_mid_stream_frees_every_block_within_a_second(service):
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    prompt = list(range(100, 180))  # 80 tokens: 5+ blocks on both workers
    with Client(service.address, timeout=60) as client:
        stream = client.generate(prompt, sampling=params)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        wait_until(lambda: any(w.num_used_blocks for w in stats(service.address).workers
                               if w.role == "decode"), 2, "the stream holds decode blocks")
        stream.close()  # cancels the RPC
    time.sleep(1.0)
    after = stats(service.address)
    assert all(w.num_used_blocks == 0 for w in after.workers), after


def test_abort_by_request_id_ends_the_stream(service):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    chunks = []
    with Client(service.address, timeout=60) as client:
        started = threading.Event()

        def read():
            for chunk in client.generate([9, 8, 7], sampling=params, request_id="to-abort"):
                chunks.append(chunk)
                started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(30)
        assert client.abort("to-abort")
        reader.join(30)
        assert not client.abort("to-abort")  # gone
    assert chunks[-1].finish_reason == "abort"
    assert chunks[-1].usage.completion_tokens < 400
    assert wait_until(lambda: all_blocks_free(service.address), 5, "every block freed")


def test_deadline_exceeded_frees_blocks(service):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with Client(service.address) as client, pytest.raises(PdserveError) as err:
        client.complete([1, 2, 3, 4], sampling=params, timeout=0.5)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: all_blocks_free(service.address), 5, "every block freed")


def test_model_info_stats_and_metrics(service):
    import urllib.request

    with Client(service.address) as client:
        info = client.model_info()
        assert info.max_model_len == 512 and info.block_size == 16
        assert {(w.worker_id, w.role, w.up) for w in client.stats().workers} == {
            ("prefill-0", "prefill", True), ("decode-0", "decode", True)}
    url = f"http://127.0.0.1:{service.service.metrics_port}/metrics"
    name = "pdserve_time_to_first_token_seconds_count"
    before = sample_value(urllib.request.urlopen(url, timeout=5).read(), name)
    with Client(service.address, timeout=60) as client:
        for i in range(3):
            client.complete([3, 1, 4, i], sampling=GREEDY)
    text = urllib.request.urlopen(url, timeout=5).read()
    assert sample_value(text, name) == before + 3  # one TTFT per request, seen by the router
    assert sample_value(text, "pdserve_kv_blocks_total", {"worker": "decode-0"}) == 256
    # the decode worker's steps take the token budget; the prefill worker's are sized in time
    budget = {w: sample_value(text, "pdserve_step_token_budget", {"worker": w})
              for w in ("prefill-0", "decode-0")}
    assert budget["decode-0"] == 512 and 16 <= budget["prefill-0"] <= 512


def call_error(address: str, request: pdserve_pb2.GenerateRequest) -> grpc.RpcError:
    return raw_generate(address, request.SerializeToString())


def test_bench_against_the_service_writes_table_json_png(service, tmp_path, capsys):
    import json

    from pdserve.cli import build_parser
    from pdserve.cli import main as cli_main

    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["bench", "--address", service.address, "--workload", "grid", "--input-lens", "24",
            "--output-lens", "12", "--num-per-cell", "8", "--rates", "inf,50",
            "--slo", "ttft=5000,tpot=1000", "--json", str(out_json), "--png", str(out_png),
            "--metrics-url", f"http://127.0.0.1:{service.service.metrics_port}/metrics",
            "--no-progress"]
    build_parser().parse_args(argv)  # the CLI accepts what the docs show
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "router histogram ttft p50" in printed
    data = json.loads(out_json.read_text())
    assert [len(run["records"]) for run in data["runs"]] == [8, 8]
    assert all(r["error"] is None for run in data["runs"] for r in run["records"])
    assert all(run["summary"]["num_ok"] == 8 for run in data["runs"])
    for run in data["runs"]:  # the router saw the same requests the client timed
        assert run["extra"]["ttft"]["router_p50_s"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
