"""Multi-LoRA over the served PD path (real Ray prefill and decode workers, router, Redis, both
fronts): the shared service serves the tiny model's three adapters (two per step); a request's
`model` picks one. Each answer is transformers' greedy answer on the merged weights; the same
prompt under two adapters shares no KV; adapters load and unload at run time, and a bad one is
a 400 naming the field while the server keeps serving."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from pdserve.client import Client
from pdserve.client.rpc import PdserveError
from tests.e2e.harness import stats, token_prompts, wait_until
from tests.integration.test_lora import GREEDY, hf_lora_greedy
from tests.lora_adapters import write_lora_adapter


@pytest.fixture(scope="module")
def service(tiny_service):
    return tiny_service


def generate(service, prompt: list[int], model: str = ""):
    """Greedy token ids and the usage of one gRPC request."""
    with Client(service.address) as client:
        done = client.complete(prompt, model=model, sampling=GREEDY)
    return list(done.token_ids), done.usage


def all_free(service) -> None:
    wait_until(lambda: all(w.num_used_blocks == 0 for w in stats(service.address).workers),
               30, "every block freed")


def test_adapters_listed_with_their_parent(service, tiny_lora_dirs):
    models = httpx.get(f"{service.http_url}/v1/models").json()["data"]
    base = models[0]["id"]
    assert {m["id"]: m["parent"] for m in models[1:]} == {n: base for n in tiny_lora_dirs}
    with Client(service.address) as client:
        assert sorted(client.model_info().lora_adapters) == sorted(tiny_lora_dirs)


def test_each_adapter_answers_as_its_merged_weights(service, tiny_llama_dir, tiny_lora_dirs):
    names = ["", *sorted(tiny_lora_dirs)] * 3
    prompts = token_prompts(len(names), seed=41)
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda job: generate(service, *job)[0], zip(prompts, names)))
    for prompt, name, tokens in zip(prompts, names, got):
        adapter = tiny_lora_dirs[name] if name else None
        assert tokens == hf_lora_greedy(tiny_llama_dir, adapter, tuple(prompt)), name
    reply = httpx.post(f"{service.http_url}/v1/completions", timeout=60, json={
        "model": "mlp", "prompt": prompts[3], "max_tokens": GREEDY.max_tokens,
        "temperature": 0, "ignore_eos": True}).json()
    text = reply["choices"][0]["text"]
    assert reply["model"] == "mlp"
    with Client(service.address) as client:
        assert text == client.complete(prompts[3], model="mlp", sampling=GREEDY).text
    all_free(service)


def test_same_prompt_under_two_adapters_shares_no_blocks(service):
    prompt = token_prompts(1, seed=42)[0] * 4  # 48+ tokens: three full blocks
    first, usage = generate(service, prompt, "all")
    other, other_usage = generate(service, prompt, "attn")
    again, again_usage = generate(service, prompt, "all")
    assert other_usage.cached_tokens == 0 and other != first
    assert again_usage.cached_tokens >= 32 and again == first
    all_free(service)


def test_adapters_load_and_unload_at_run_time(service, tiny_llama_dir, tmp_path):
    url = service.http_url
    late = write_lora_adapter(tiny_llama_dir, tmp_path / "late", rank=8, seed=14)
    prompt = token_prompts(1, seed=43)[0]
    ok = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late",
                                                        "lora_path": str(late)})
    assert ok.status_code == 200, ok.text
    assert generate(service, prompt, "late")[0] == hf_lora_greedy(tiny_llama_dir, late,
                                                                 tuple(prompt))
    wide = write_lora_adapter(tiny_llama_dir, tmp_path / "wide", rank=32, seed=15)
    refusals = {
        ("late", str(late)): "lora_name",  # already served
        ("lost", str(tmp_path / "absent")): "lora_path",
        ("wide", str(wide)): "lora_path",  # rank 32 > max_lora_rank 16
        ("", str(late)): "lora_name",
    }
    for (name, path), field in refusals.items():
        reply = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name,
                                                                "lora_path": path})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    assert httpx.post(f"{url}/v1/unload_lora_adapter",
                      json={"lora_name": "late"}).status_code == 200
    assert httpx.post(f"{url}/v1/unload_lora_adapter",
                      json={"lora_name": "late"}).status_code == 404
    gone = httpx.post(f"{url}/v1/completions", json={"model": "late", "prompt": prompt,
                                                     "max_tokens": 2})
    assert gone.status_code == 404 and "not served here" in gone.text
    with Client(service.address) as client, pytest.raises(PdserveError) as err:
        client.complete(prompt, model="late", sampling=GREEDY)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "late" not in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert generate(service, prompt)[0]  # the base model still serves
    all_free(service)
