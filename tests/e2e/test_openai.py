"""The OpenAI-compatible HTTP API, driven by the official `openai` client, over the whole
service (real Ray workers, Redis, router) serving a tiny random Llama."""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.metrics_text import sample_value
from pdserve.router.openai.app import OpenAIApp
from pdserve.router.openai.server import HTTPServer
from tests.e2e.harness import MAX_INFLIGHT, MAX_QUEUED, stats, wait_until

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def service(tiny_service):
    """The package's shared service (tests/e2e/conftest.py), with its OpenAI front."""
    return tiny_service


@pytest.fixture(scope="module")
def http_url(service) -> str:
    """The Service's own OpenAI front (what `pdserve up --http-port` starts)."""
    assert service.http_url.startswith("http://127.0.0.1:")
    return service.http_url


@pytest.fixture(scope="module")
def client(http_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@contextlib.contextmanager
def running_http(service, api_token: str):
    """A second OpenAI front on the service's router, with an API key, on a free port."""
    server = HTTPServer(OpenAIApp(service.router, lambda: True, api_token).app)
    service.run(server.start())
    try:
        yield server.url
    finally:
        service.run(server.stop())


def all_blocks_free(service) -> bool:
    return all(w.num_used_blocks == 0 and w.up for w in stats(service.address).workers)


def test_models_lists_the_served_model(client, tiny_llama_dir, tiny_lora_dirs) -> None:
    """The model first, then the LoRA adapters the shared service serves over it."""
    models = client.models.list().data
    assert models[0].id == tiny_llama_dir.name
    assert {m.id for m in models[1:]} == set(tiny_lora_dirs)


def test_completion_matches_offline_greedy(client, model, offline) -> None:
    expected = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12,
                                                         ignore_eos=True))[0]
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streamed_equals_whole(client, model) -> None:
    kwargs = {"model": model, "max_tokens": 16, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(prompt=PROMPT, **kwargs).choices[0].text
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    messages = [{"role": "user", "content": "Say something."}]
    chat_whole = client.chat.completions.create(messages=messages, **kwargs)
    stream = client.chat.completions.create(messages=messages, stream=True,
                                            stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_whole.choices[0].message.content != ""
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == chat_whole.usage.prompt_tokens


def test_seeded_sampling_is_reproducible(client, model) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


def test_stop_string_cuts_the_text(client, model) -> None:
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    stop = whole[len(whole) // 2: len(whole) // 2 + 3]
    assert stop.strip()
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert got.text == whole[: whole.index(stop)]
    assert got.finish_reason == "stop" and got.model_extra["stop_reason"] == stop


def test_n_choices(client, model) -> None:
    kwargs = {"model": model, "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 5,
              "extra_body": {"ignore_eos": True}}
    got = client.completions.create(prompt=[PROMPT, "Hello"], **kwargs)
    assert [c.index for c in got.choices] == list(range(6))
    assert len({c.text for c in got.choices[:3]}) > 1  # seed + i per choice
    again = client.completions.create(prompt=[PROMPT, "Hello"], **kwargs)
    assert [c.text for c in again.choices] == [c.text for c in got.choices]
    prompt_tokens = [client.completions.create(model=model, prompt=p, max_tokens=1)
                     .usage.prompt_tokens for p in (PROMPT, "Hello")]
    assert got.usage.prompt_tokens == sum(prompt_tokens)  # each prompt counted once
    assert got.usage.completion_tokens == 6 * 8
    chat = client.chat.completions.create(model=model, n=2, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert len(chat.choices) == 2
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_logprobs(client, model, offline) -> None:
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    lp = got.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == got.text
    assert all(len(top) <= 2 and max(top.values()) >= lp.token_logprobs[i] - 1e-6
               for i, top in enumerate(lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    chat = client.chat.completions.create(
        model=model, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
        messages=[{"role": "user", "content": "Hi"}], extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.logprob <= 0 and bytes(e.bytes).decode() == e.token for e in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content


def test_echo_and_prompt_logprobs_match_the_offline_api(client, model, offline, service):
    """Prompt logprobs computed by the prefill worker (or a local prefill) equal the offline
    engine's; echo puts the prompt and its tokens' logprobs ahead of the completion."""
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=3,
                            ignore_eos=True)
    (want,) = offline.generate([PROMPT], params)
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True, "prompt_logprobs": 3})
    choice = got.choices[0]
    assert choice.text == PROMPT + want.text
    prompt = choice.model_extra["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(want.prompt_token_ids)
    for position, expected in zip(prompt[1:], want.prompt_logprobs[1:]):
        assert [int(t) for t in position] == list(expected)  # the prompt token, then the top 3
        for token_id, entry in position.items():
            e = expected[int(token_id)]
            assert (entry["rank"], entry["decoded_token"]) == (e.rank, e.decoded_token)
            assert entry["logprob"] == pytest.approx(e.logprob, abs=1e-4)
    lp = choice.logprobs
    n = len(want.prompt_token_ids)
    assert len(lp.tokens) == n + 4 and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(
        [p[t].logprob for p, t in zip(want.prompt_logprobs[1:], want.prompt_token_ids[1:])],
        abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 4)]
    sampling = pdserve_pb2.SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    with grpc.insecure_channel(service.address) as channel:
        first = next(iter(pdserve_pb2_grpc.InferenceStub(channel).Generate(
            pdserve_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling), timeout=60)))
    assert [lp.token_id for lp in first.prompt_logprobs] == want.prompt_token_ids[1:]
    assert [lp.rank for lp in first.prompt_logprobs] == [
        p[t].rank for p, t in zip(want.prompt_logprobs[1:], want.prompt_token_ids[1:])]


@pytest.mark.parametrize(("endpoint", "body", "param"), [
    ("completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("completions", {"prompt": PROMPT, "top_p": 2}, "top_p"),
    ("completions", {"prompt": PROMPT, "top_k": "x"}, "top_k"),
    ("completions", {"prompt": PROMPT, "min_p": 1.5}, "min_p"),
    ("completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": PROMPT, "max_tokens": 100000}, "max_tokens"),
    ("completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("completions", {"prompt": PROMPT, "logprobs": 50}, "logprobs"),
    ("completions", {"prompt": PROMPT, "seed": -3}, "seed"),
    ("completions", {"prompt": PROMPT, "stop": 5}, "stop"),
    ("completions", {"prompt": PROMPT, "stop_token_ids": [10**8]}, "stop_token_ids"),
    ("completions", {"prompt": PROMPT, "presence_penalty": 5}, "presence_penalty"),
    ("completions", {"prompt": PROMPT, "suffix": "x"}, "suffix"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [10**8]}, "prompt"),
    ("completions", {}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 100000}, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_parameter_is_a_400_naming_it(http_url, model, endpoint, body, param) -> None:
    reply = httpx.post(f"{http_url}/v1/{endpoint}", json={"model": model, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"] or param == "prompt"


def test_unknown_model_is_a_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert err.value.body["code"] == "model_not_found"


def test_api_key(service, model, tiny_llama_dir) -> None:
    with running_http(service, api_token="sesame") as url:
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        missing = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "x"})
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        for path in ("load_lora_adapter", "unload_lora_adapter"):  # adapters change behind it
            assert httpx.post(f"{url}/v1/{path}", json={"lora_name": "all"}).status_code == 401
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(model=model, prompt=PROMPT, max_tokens=2).choices
        assert httpx.get(f"{url}/health").status_code == 200  # probes stay open


def test_overload_is_a_429(service, client, model) -> None:
    def one(_) -> int:
        try:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=200,
                                      extra_body={"ignore_eos": True})
            return 200
        except openai.RateLimitError:
            return 429

    with ThreadPoolExecutor(40) as pool:
        codes = list(pool.map(one, range(40)))
    assert codes.count(429) >= 40 - MAX_INFLIGHT - MAX_QUEUED - 4
    assert codes.count(200) >= MAX_INFLIGHT
    assert wait_until(lambda: all_blocks_free(service), 10, "every block freed")


def test_disconnect_frees_every_block(service, http_url, model) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{http_url}/v1/completions", json=body) as reply:
        events = 0
        for line in reply.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    assert events == 3
    closed = time.monotonic()
    wait_until(lambda: not service.router.flights, 1.0, "the router dropped the request")
    wait_until(lambda: all_blocks_free(service), 1.5, "every block freed on every worker")
    assert time.monotonic() - closed < 1.5


def test_deadline_is_a_504_and_frees_blocks(service, http_url, model) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "timeout": 0.2}
    reply = httpx.post(f"{http_url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "timeout"
    assert wait_until(lambda: all_blocks_free(service), 2, "every block freed")


def test_concurrent_streams_match_a_lone_one(client, model) -> None:
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    lone = client.completions.create(**kwargs).choices[0].text

    def streamed(_) -> str:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)
                       if c.choices)

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(streamed, range(16))) == [lone] * 16


def test_health_ready_and_metrics(http_url) -> None:
    assert httpx.get(f"{http_url}/health").status_code == 200
    ready = httpx.get(f"{http_url}/ready")
    assert ready.status_code == 200 and json.loads(ready.text) == {"ready": True}
    metrics = httpx.get(f"{http_url}/metrics").text
    assert "pdserve_requests_total" in metrics


def test_bench_drives_the_openai_api(http_url, tiny_llama_dir, tmp_path, capsys) -> None:
    from pdserve.cli import main as cli_main

    out_json = tmp_path / "b.json"
    argv = ["bench", "--backend", "openai", "--base-url", f"{http_url}/v1", "--tokenizer",
            str(tiny_llama_dir), "--workload", "sessions", "--num-sessions", "4", "--turns", "2",
            "--first-len", "40", "--turn-len", "8", "--output-len", "10",
            "--json", str(out_json), "--png", "", "--no-progress"]
    assert cli_main(argv) == 0
    assert "TTFT" in capsys.readouterr().out
    (run,) = json.loads(out_json.read_text())["runs"]
    records = run["records"]
    assert len(records) == 8 and all(r["error"] is None for r in records)
    assert all(sum(r["chunk_tokens"]) == 10 for r in records)  # usage tops up held-back text
    second_turns = [r for r in records if r["request_id"].endswith("-1")]
    assert sum(r["cached_tokens"] for r in second_turns) > 0  # sessions reached the router


def test_finished_requests_count_as_ok_not_cancelled(client, model, http_url) -> None:
    def counts() -> tuple[float, float]:
        text = httpx.get(f"{http_url}/metrics").text
        return tuple(sample_value(text, "pdserve_requests_total", {"status": s})
                     for s in ("ok", "cancelled"))

    ok, cancelled = counts()
    client.completions.create(model=model, prompt=PROMPT, max_tokens=4)
    list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, stream=True))
    client.chat.completions.create(model=model, max_tokens=4,
                                   messages=[{"role": "user", "content": "Hi"}])
    assert counts() == (ok + 3, cancelled)
