"""Decode-death migration through the real router (issue 18).

A real `Router` in this process over real, authenticated worker gRPC services (one prefill,
two TP-1 decode workers, gloo KV channels on 127.0.0.1). A request's decode worker fails it
mid-stream: killed (its server stops: the output stream breaks), marked down by the supervisor
(alive, so it must be told to free the request), or its engine loop dies (the request ends
with an error). The stream must go on on the other decode worker with exactly the tokens of
an undisturbed run (greedy and seeded sampling, fp32 tiny model), none repeated or missing,
usage over the client's prompt and every token; `migration_limit=0` and a lone decode worker
end it UNAVAILABLE (WorkerLost) as before. An Abort or a cancel while the request is being
placed again, or after, frees every block on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import jsonschema
import pytest

from pdserve.engine.engine_core import EngineCore
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_outputs_params import StructuredOutputsParams
from pdserve.proto import pdserve_pb2, worker_pb2
from pdserve.router.router import Router
from pdserve.router.validation import ValidRequest
from pdserve.router.workers import WorkerLost
from tests.faults.router_fakes import make_router
from tests.faults.worker_plane import (
    AUTH,
    SECRET,
    decode_stub,
    prefill_stub,
    sampling,
    source_of,
    start_decode,
    start_prefill,
    worker_spec,
)
from tests.workers.pd import run_engine

PROMPT = tuple(range(200, 230))
MAX_TOKENS = 200  # long enough that the failure lands mid-stream (a step takes ms)
ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
         "minItems": 20, "maxItems": 30}
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True),
    # a grammar (an array that ends well within MAX_TOKENS) and penalties: the new decode
    # worker replays the streamed tokens into the matcher and the counts
    "constrained": SamplingParams(
        temperature=0.8, seed=6, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.3,
        repetition_penalty=1.2, structured_outputs=StructuredOutputsParams(json=json.dumps(ARRAY))),
}
LORA = "lora"  # greedy, with the tiny model's "all" adapter: the new worker reads it too
DECODES = ("decode-0", "decode-1")
SETTLE_S = 10.0  # spawned aborts and the load polls, on 2 shared cores


@dataclass
class Services:
    prefill: object  # PrefillService
    decode: dict  # worker id -> DecodeService
    stopped: set

    def stop(self, worker_id: str) -> None:
        """The worker's server stops at once (its streams break) and its engine with it."""
        service = self.decode[worker_id]
        self.stopped.add(worker_id)
        service.server.stop(grace=0)
        service.worker.close()

    def used_blocks(self) -> dict[str, int]:
        """Used and reserved KV blocks of every worker still running."""
        workers = {"prefill-0": self.prefill.worker} | {
            w: s.worker for w, s in self.decode.items() if w not in self.stopped}
        return {w: worker.stats().num_used_blocks + worker.stats().num_reserved
                for w, worker in workers.items() if worker.is_alive()}


@pytest.fixture(scope="module")
def adapter(tiny_lora_dirs) -> LoRARequest:
    return LoRARequest("all", 1, str(tiny_lora_dirs["all"]))


@pytest.fixture(scope="module")
def undisturbed(tiny_llama_dir, adapter) -> dict[str, list[int]]:
    """The offline engine's tokens for PROMPT, per sampling kind (the workers' engine)."""
    config = worker_spec(tiny_llama_dir, "reference").engine_config()
    tokens = {kind: run_engine(EngineCore(config), [list(PROMPT)], params)[0]
              for kind, params in PARAMS.items()}
    tokens[LORA] = run_engine(EngineCore(config), [list(PROMPT)], PARAMS["greedy"],
                              [adapter])[0]
    assert tokens[LORA] != tokens["greedy"]
    return tokens


@pytest.fixture()
def services(tiny_llama_dir):
    prefill = start_prefill(worker_spec(tiny_llama_dir, "prefill-0"), SECRET)
    decode = {w: start_decode(worker_spec(tiny_llama_dir, w), SECRET) for w in DECODES}
    svc = Services(prefill, decode, set())
    yield svc
    for w in DECODES:
        if w not in svc.stopped:
            decode[w].stop()
    prefill.stop()


@contextlib.asynccontextmanager
async def routed(model, services: Services, decodes=DECODES, **config):
    router = make_router(model, SECRET, **config)
    await router.add_worker("prefill-0", "prefill", services.prefill.address)
    for w in decodes:
        await router.add_worker(w, "decode", services.decode[w].address)
    try:
        await router.wait_ready(20)
        yield router
    finally:
        await router.close()


def request(kind: str, rid: str = "req-1", adapter: LoRARequest | None = None) -> ValidRequest:
    if kind == LORA:
        return ValidRequest(rid, PROMPT, PARAMS["greedy"], "", lora=adapter)
    return ValidRequest(rid, PROMPT, PARAMS[kind], "")


@dataclass
class Run:
    messages: list[pdserve_pb2.GenerateResponse]
    failed_on: str  # the decode worker that failed the request
    placed_on: list[str]  # the decode worker holding the request at each message

    @property
    def token_ids(self) -> list[int]:
        return [t for m in self.messages for t in m.token_ids]


async def run_failing(router: Router, req: ValidRequest, fail: Callable[[str], None],
                      run: Run | None = None) -> Run:
    """Every message of `req` (into `run`); `fail(worker_id)` on its decode worker once a
    token arrived."""
    run = Run([], "", []) if run is None else run
    async for message in router.generate(req, time.monotonic()):
        run.messages.append(message)
        flight = router.flights[req.request_id]
        run.placed_on.append(flight.decode.worker_id if flight.decode else "")
        if not run.failed_on and run.token_ids:
            run.failed_on = run.placed_on[-1]
            fail(run.failed_on)
    return run


def migrations(router: Router, outcome: str) -> float:
    return router.metrics.registry.get_sample_value("pdserve_router_migrations_total",
                                                    {"outcome": outcome})


async def settled(services: Services, router: Router) -> dict[str, int]:
    """Used blocks of every running worker once they are all 0 (or SETTLE_S passed)."""
    end = time.monotonic() + SETTLE_S
    while any((held := services.used_blocks()).values()) or router.flights:
        if time.monotonic() > end:
            break
        await asyncio.sleep(0.05)
    return held


def failure(kind: str, router: Router, services: Services) -> Callable[[str], None]:
    if kind == "killed":
        return services.stop
    if kind == "marked-down":
        return router.mark_down

    def loop_dies(worker_id: str) -> None:
        def step():
            raise RuntimeError("injected: a TP rank died")
        services.decode[worker_id].worker.core.step = step
    return loop_dies


@pytest.mark.parametrize(("how", "sampled"), [
    (how, sampled) for how in ("killed", "marked-down", "loop-dies")
    for sampled in ("greedy", "seeded")] + [("killed", "constrained"), ("killed", LORA)])
def test_the_stream_continues_on_the_other_decode_worker(model, services, undisturbed, how,
                                                         sampled, adapter) -> None:
    async def main():
        async with routed(model, services) as router:
            before = [m async for m in router.generate(request(sampled, "before", adapter),
                                                       time.monotonic())]
            run = await asyncio.wait_for(run_failing(
                router, request(sampled, adapter=adapter), failure(how, router, services)), 60)
            return before, run, migrations(router, "ok"), await settled(services, router)

    before, run, migrated, held = asyncio.run(main())
    expected = undisturbed[sampled]
    assert [t for m in before for t in m.token_ids] == expected  # the router's own run
    assert run.token_ids == expected  # none missing, none twice, the same choices
    assert "".join(m.text for m in run.messages) == "".join(m.text for m in before)
    last = run.messages[-1]
    assert (last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens) == (
        "stop" if sampled == "constrained" else "length", len(PROMPT), len(expected))
    if sampled == "constrained":  # the grammar held across the two workers
        jsonschema.validate(json.loads("".join(m.text for m in run.messages)), ARRAY)
    other = next(w for w in DECODES if w != run.failed_on)
    assert run.placed_on[-1] == other and migrated == 1
    assert not any(held.values()), held


def test_limit_zero_fails_the_request_unavailable(model, services) -> None:
    async def main():
        async with routed(model, services, migration_limit=0) as router:
            with pytest.raises(WorkerLost):
                await asyncio.wait_for(run_failing(router, request("greedy"), router.mark_down),
                                       60)
            return migrations(router, "ok"), await settled(services, router)

    migrated, held = asyncio.run(main())
    assert migrated == 0
    assert not any(held.values()), held  # the marked-down worker was told to free it


def test_no_other_decode_worker_fails_the_request_unavailable(model, services) -> None:
    async def main():
        async with routed(model, services, decodes=DECODES[:1]) as router:
            with pytest.raises(WorkerLost, match="no other decode worker"):
                await asyncio.wait_for(run_failing(router, request("greedy"), services.stop),
                                       60)
            return migrations(router, "failed"), await settled(services, router)

    failed, held = asyncio.run(main())
    assert failed == 1
    assert not any(held.values()), held


def hold_migrations(router: Router) -> tuple[asyncio.Event, asyncio.Event]:
    """(migrating, release): a migrated request's Prefill waits for `release`; `migrating`
    is set once one does (the decode worker has reserved its blocks by then)."""
    client = router.prefill["prefill-0"]
    prefill, migrating, release = client.prefill, asyncio.Event(), asyncio.Event()

    async def held(request: worker_pb2.PrefillRequest, num_tokens: int, timeout: float):
        if request.num_output_tokens:
            migrating.set()
            await release.wait()
        return await prefill(request, num_tokens, timeout=timeout)

    client.prefill = held
    return migrating, release


@pytest.mark.parametrize("when", ["abort-during", "cancel-during", "abort-after"])
def test_abort_or_cancel_around_a_migration_frees_everything(model, services, when) -> None:
    async def main():
        async with routed(model, services) as router:
            migrating, release = hold_migrations(router)
            if when == "abort-after":
                release.set()
            run = Run([], "", [])
            task = asyncio.create_task(run_failing(router, request("seeded"), router.mark_down,
                                                   run))
            await asyncio.wait_for(migrating.wait(), 30)
            if when == "abort-after":  # the new decode worker streams before the abort
                await asyncio.wait_for(_until(
                    lambda: run.placed_on[-1] not in ("", run.failed_on)), 30)
            if when == "cancel-during":
                task.cancel()
            else:
                assert await router.abort("req-1")
                release.set()
            try:
                await asyncio.wait_for(task, 30)
            except asyncio.CancelledError:
                run = None
            open_mailboxes = sum(c.num_open for c in router.decode.values())
            return run, await settled(services, router), open_mailboxes

    run, held, open_mailboxes = asyncio.run(main())
    if when == "cancel-during":
        assert run is None
    else:
        last = run.messages[-1]
        assert last.finish_reason == "abort"
        assert last.usage.completion_tokens == len(run.token_ids) < MAX_TOKENS
        assert last.usage.prompt_tokens == len(PROMPT)
    assert not any(held.values()), held
    assert open_mailboxes == 0


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.005)


@pytest.mark.parametrize(("field", "bad"), [
    ("num_output_tokens", {"num_output_tokens": -1}),
    ("num_output_tokens", {"num_output_tokens": len(PROMPT)}),
    ("lora_path", {"lora": worker_pb2.LoRAAdapter(name="gone", id=1, path="/no/such/adapter")}),
    ("lora_int_id", {"lora": worker_pb2.LoRAAdapter(name="x", id=0, path="/adapters/x")}),
])
def test_worker_rpcs_refuse_a_bad_field(services, field, bad) -> None:
    """A bad migrated tail or LoRA adapter: INVALID_ARGUMENT naming it, nothing held."""
    p_channel, p = prefill_stub(services.prefill.address)
    d_channel, d = decode_stub(services.decode["decode-0"].address)
    prompt, source = list(PROMPT), source_of(services.prefill)
    try:
        calls = {
            "Reserve": lambda: d.Reserve(worker_pb2.ReserveRequest(
                request_id="bad", prompt_token_ids=prompt, sampling=sampling(),
                sources=[source], deadline=time.time() + 30, **bad),
                metadata=AUTH, timeout=30),
            "Submit": lambda: d.Submit(worker_pb2.SubmitRequest(
                request_id="bad", prompt_token_ids=prompt, sampling=sampling(), **bad),
                metadata=AUTH, timeout=30),
        }
        reserved = d.Reserve(worker_pb2.ReserveRequest(
            request_id="ok", prompt_token_ids=prompt, sampling=sampling(), sources=[source],
            deadline=time.time() + 30), metadata=AUTH, timeout=30)
        calls["Prefill"] = lambda: p.Prefill(worker_pb2.PrefillRequest(
            request_id="ok", prompt_token_ids=prompt, sampling=sampling(),
            descriptor=reserved.descriptor, **bad), metadata=AUTH, timeout=30)
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert field in caught.value.details(), name
        d.Abort(worker_pb2.WorkerAbortRequest(request_id="ok"), metadata=AUTH, timeout=30)
        assert not any(services.used_blocks().values())
    finally:
        p_channel.close()
        d_channel.close()
