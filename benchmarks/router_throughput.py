"""The router's ceiling, measured alone: a synthetic decode worker behind the real router.

    python -m benchmarks.router_throughput [--fronts grpc,http] [--streams 64,256]
        [--router-processes 1,2,4] [--grpc-server h2,grpcio] [--max-tokens 256]
        [--step-ms 5] [--duration 20] [--profile]

Processes: the synthetic decode worker (benchmarks.synthetic_decode: no model, one
StepOutputs per `step_ms` with a token for every running request, several steps merged into
one message when a router reads slower, as a real decode worker does), N router processes
(the real Router + RouterServer + OpenAI HTTP front, colocated mode: the router Submits to the
decode worker; no prefill worker; the bundled SmolLM2 tokenizer; uvloop) sharing one gRPC and
one HTTP port through SO_REUSEPORT as `pdserve up --router-processes N` does (the gRPC port
on each `--grpc-server` front in turn: the router's own HTTP/2, grpc.aio's), and this one:
closed-loop streams of token-id prompts (max_tokens M, ignore_eos) over grpc.aio (4 streams
per connection), or httpx SSE to /v1/completions (a connection per stream).

The client side (this process): each of `streams` streams sends a request, reads it to its
end, and sends the next until the phase's duration is over; `Recorder` keeps every token's
receive time and step index (the synthetic decode worker's token says which step produced
it), each request's TTFT and outcome. gRPC: grpc.aio, 4 streams per connection (a connection
of its own per channel), a fixed 16 KiB HTTP/2 window per stream. HTTP: httpx SSE to
/v1/completions, a connection per stream.

Per router count, front and concurrency: streamed tok/s (tokens received inside the duration
window) beside the offered rate (streams x 1000 / step_ms); tokens per message (1.0: no
coalescing; more when the router or client fell behind and deltas merged); router CPU per
token (psutil user + system CPU of the router processes over the phase, drain included, /
tokens); CPU utilisation (1.0 = one core) of routers, worker and client (a saturated client or
worker caps the number, not the router); p50 / p99 added latency per token (client receive
time minus the time the worker's clock produced that token's step, both `time.monotonic()`);
thread counts. `--profile`: each router's event-loop thread under cProfile (CPU numbers then
include the profiler), top functions by cumulative and by own time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import itertools
import json
import logging
import os
import pstats
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import psutil

from benchmarks.synthetic_decode import Child, StepTokens, spawn, start_worker
from pdserve.cluster_secret import ClusterSecret
from pdserve.engine.default_model import ensure_default_model
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.config import GRPC_SERVERS

MODEL_NAME = "SmolLM2-135M-Instruct"


def start_routers(count: int, secret: ClusterSecret, worker_address: str, http: bool,
                  profile: bool, grpc_server: str = "h2") -> list[Child]:
    """`count` router processes sharing one gRPC and one HTTP port (SO_REUSEPORT: the kernel
    spreads connections over them, as `pdserve up --router-processes` does), each with its
    own subscription to the worker."""
    routers: list[Child] = []
    ports = (0, 0)  # the first router picks free ports; the others bind the same
    try:
        for _ in range(count):
            routers.append(spawn(_router_main, secret, worker_address, http, profile, ports,
                                 grpc_server))
            ports = (routers[0].info["grpc_port"], routers[0].info["http_port"])
        return routers
    except BaseException:
        for router in routers:
            router.stop()
        raise


def _router_main(conn, secret: ClusterSecret, worker_address: str, http: bool,
                 profile: bool, ports: tuple[int, int], grpc_server: str) -> None:
    import uvloop

    logging.basicConfig(level=logging.WARNING)
    uvloop.run(_serve_router(conn, secret, worker_address, http, profile, ports, grpc_server))


async def _serve_router(conn, secret: ClusterSecret, worker_address: str, http: bool,
                        profile: bool, ports: tuple[int, int], grpc_server: str) -> None:
    from pdserve.router.config import RouterConfig
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.openai.app import OpenAIApp
    from pdserve.router.openai.server import HTTPServer
    from pdserve.router.router import Router
    from pdserve.router.server import RouterServer
    from pdserve.router.validation import ModelContext

    model = await asyncio.to_thread(ModelContext.load, str(ensure_default_model()), MODEL_NAME)
    router = Router(model, RouterConfig(colocated=True, max_inflight_requests=1024),
                    RouterMetrics(), secret=secret)
    await router.add_worker("decode-0", "decode", worker_address)
    server = RouterServer(router, "127.0.0.1", ports[0], grpc_server=grpc_server)
    await router.wait_ready(timeout=60)
    await server.start()
    front = None
    if http:
        front = HTTPServer(OpenAIApp(router, server.can_serve).app, "127.0.0.1", ports[1])
        await front.start()
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    conn.send_bytes(json.dumps({"pid": os.getpid(), "grpc": server.address,
                                "grpc_port": server.port, "http_port": front and front.port,
                                "http": front.url if front else None}).encode())
    await asyncio.to_thread(conn.recv_bytes)  # "stop"
    text = io.StringIO()
    if profiler is not None:
        profiler.disable()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(25)
        stats.sort_stats("tottime").print_stats(25)
    if front is not None:
        await front.stop()
    await server.stop(grace=0)
    conn.send_bytes(json.dumps({"profile": text.getvalue()}).encode())


class Recorder:
    """Every streamed token's receive time and step index, and each request's outcome."""

    def __init__(self) -> None:
        self.recv_times: list[float] = []
        self.token_index: list[int] = []
        self.messages = 0  # messages (gRPC) or events (SSE) that carried tokens
        self.ttft: list[float] = []  # request sent -> its first token received, seconds
        self.outcomes: Counter[str] = Counter()  # "<tokens> <finish_reason>" -> requests
        self.errors: Counter[str] = Counter()

    def tokens(self, now: float, indexes: list[int]) -> None:
        self.messages += bool(indexes)
        self.recv_times.extend([now] * len(indexes))
        self.token_index.extend(indexes)

    def finished(self, num_tokens: int, reason: str) -> None:
        self.outcomes[f"{num_tokens} {reason or '-'}"] += 1


@dataclass(frozen=True)
class Load:
    front: str  # "grpc" | "http"
    streams: int
    max_tokens: int
    prompt: tuple[int, ...]
    duration_s: float


STREAMS_PER_CONNECTION = 4  # the gRPC client's streams share connections, this many each
# a fixed 16 KiB HTTP/2 window per stream: with BDP probing a client slower than the router
# lets its window grow to megabytes and buffers seconds of tokens in it, so the router never
# sees that the client fell behind (and this 2-core machine's client is slower than the router)
CLIENT_WINDOW = [("grpc.http2.lookahead_bytes", 16384), ("grpc.http2.bdp_probe", 0)]


async def grpc_load(load: Load, address: str, index: dict[int, int], rec: Recorder) -> None:
    import grpc

    from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

    # a connection of its own per channel (no shared subchannel): the kernel spreads
    # connections, not streams, over router processes
    options = [("grpc.use_local_subchannel_pool", 1), *CLIENT_WINDOW]
    channels = [grpc.aio.insecure_channel(address, options=options)
                for _ in range(-(-load.streams // STREAMS_PER_CONNECTION))]
    stubs = [pdserve_pb2_grpc.InferenceStub(c) for c in channels]
    sampling = pdserve_pb2.SamplingParams(max_tokens=load.max_tokens, temperature=0,
                                          ignore_eos=True)
    end = time.monotonic() + load.duration_s

    async def stream(i: int) -> None:
        n = 0
        while time.monotonic() < end:
            request = pdserve_pb2.GenerateRequest(request_id=f"s{i}-{n}", sampling=sampling,
                                                  prompt_token_ids=load.prompt)
            n, got, reason, sent = n + 1, 0, "", time.monotonic()
            try:
                async for msg in stubs[i % len(stubs)].Generate(request):
                    now = time.monotonic()
                    if not got:
                        rec.ttft.append(now - sent)
                    rec.tokens(now, [index[t] for t in msg.token_ids])
                    got, reason = got + len(msg.token_ids), msg.finish_reason or reason
            except grpc.aio.AioRpcError as exc:
                rec.errors[exc.code().name] += 1
                continue
            rec.finished(got, reason)

    try:
        await asyncio.gather(*(stream(i) for i in range(load.streams)))
    finally:
        for channel in channels:
            await channel.close()


async def http_load(load: Load, url: str, words: dict[str, int], rec: Recorder) -> None:
    import httpx

    body = {"prompt": list(load.prompt), "max_tokens": load.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    end = time.monotonic() + load.duration_s
    limits = httpx.Limits(max_connections=load.streams, max_keepalive_connections=load.streams)

    async def request(client: httpx.AsyncClient, url: str) -> None:
        got, reason, usage, sent = 0, "", -1, time.monotonic()
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                rec.errors[f"HTTP {response.status_code}"] += 1
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now, chunk = time.monotonic(), json.loads(line[6:])
                for choice in chunk["choices"]:
                    indexes = [words[w] for w in choice["text"].split()]
                    if indexes and not got:
                        rec.ttft.append(now - sent)
                    rec.tokens(now, indexes)
                    got, reason = got + len(indexes), choice["finish_reason"] or reason
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
        if usage != got:
            rec.errors["usage.completion_tokens != tokens streamed"] += 1
        rec.finished(got, reason)

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        while time.monotonic() < end:
            try:
                await request(client, url)
            except httpx.HTTPError as exc:
                rec.errors[f"{type(exc).__name__}: {exc}"[:100]] += 1

    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        await asyncio.gather(*(stream(client, i) for i in range(load.streams)))


def _cpu(pids: list[int]) -> float:  # user + system seconds
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


def run_phase(load: Load, routers: list[Child], worker: Child, vocab: StepTokens,
              step_ms: float) -> dict:
    """One front at one concurrency: the load, then its numbers."""
    rec = Recorder()
    pids = {"router": [r.pid for r in routers], "worker": [worker.pid], "client": [os.getpid()]}
    start, cpu = time.monotonic(), {k: _cpu(v) for k, v in pids.items()}
    if load.front == "grpc":  # every router serves the same ports
        run = grpc_load(load, routers[0].info["grpc"], vocab.by_id, rec)
    else:
        run = http_load(load, routers[0].info["http"], vocab.by_word, rec)
    asyncio.run(run)
    wall = time.monotonic() - start
    cpu = {k: (_cpu(v) - cpu[k]) / wall for k, v in pids.items()}  # 1.0: one core
    threads = {k: sum(psutil.Process(p).num_threads() for p in v) for k, v in pids.items()}
    recv = np.asarray(rec.recv_times)
    steps = np.asarray(worker.ask("steps"))
    latency_ms = 1e3 * vocab.added_latency(recv, np.asarray(rec.token_index), steps)
    p50, p99 = np.percentile(latency_ms, [50, 99]) if latency_ms.size else (0.0, 0.0)
    return {
        "front": load.front, "streams": load.streams, "tokens": len(recv),
        "tok_s": np.count_nonzero(recv <= start + load.duration_s) / load.duration_s,
        "offered_tok_s": load.streams * 1000 / step_ms,
        # the worker's clock never catches up: fewer steps than 1000 / step_ms a second means
        # the machine's cores could not keep it (so fewer tokens were offered)
        "worker_steps_s": np.count_nonzero((steps >= start) & (steps <= start + load.duration_s))
        / load.duration_s,
        "tokens_per_message": len(recv) / max(rec.messages, 1),
        "router_us_per_token": 1e6 * cpu["router"] * wall / max(len(recv), 1),
        "router_cpu": cpu["router"], "worker_cpu": cpu["worker"], "client_cpu": cpu["client"],
        "p50_ms": float(p50), "p99_ms": float(p99), "wall_s": wall,
        "ttft_p50_ms": 1e3 * float(np.median(rec.ttft)) if rec.ttft else 0.0,
        "requests": sum(rec.outcomes.values()), "outcomes": dict(rec.outcomes),
        "errors": dict(rec.errors), "threads": threads,
        "router_rss_mb": sum(psutil.Process(p).memory_info().rss for p in pids["router"]) / 2**20,
    }


COLUMNS = ("routers", "grpc_server", "front", "streams", "tok_s", "offered_tok_s", "worker_steps_s",
           "tokens_per_message", "router_us_per_token", "router_cpu", "client_cpu",
           "worker_cpu", "p50_ms", "p99_ms", "ttft_p50_ms", "requests", "outcomes", "errors",
           "threads", "router_rss_mb")


def _row(result: dict) -> str:
    return "  ".join(f"{v:.2f}" if isinstance(v, float) else str(v)
                     for v in map(result.get, COLUMNS))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fronts", default="grpc,http", help="comma list of grpc, http")
    p.add_argument("--streams", default="64,256", help="comma list of concurrencies")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=5.0, help="the synthetic engine step")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per phase")
    p.add_argument("--router-processes", default="1",
                   help="comma list of router process counts, e.g. 1,2,4")
    p.add_argument("--grpc-server", default="h2",
                   help="comma list of the gRPC fronts to run: h2 (the router's own), grpcio")
    p.add_argument("--profile", action="store_true", help="run the router under cProfile")
    args = p.parse_args(argv)
    args.grpc_server = args.grpc_server.split(",")
    if not set(args.grpc_server) <= set(GRPC_SERVERS):
        p.error(f"--grpc-server takes {', '.join(GRPC_SERVERS)}")
    args.fronts = args.fronts.split(",")
    args.streams = [int(n) for n in args.streams.split(",")]
    args.router_processes = [int(n) for n in args.router_processes.split(",")]
    if not set(args.fronts) <= {"grpc", "http"} or min(args.streams + args.router_processes) < 1:
        p.error("--fronts takes grpc and/or http; --streams and --router-processes positive "
                "integers")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run every phase; print a row each (and the router's profile); the rows as dicts."""
    args = parse_args(argv)
    vocab = StepTokens(load_tokenizer(ensure_default_model()))
    prompt = tuple(vocab.token_ids[:args.prompt_len])
    secret = ClusterSecret.generate()
    worker = start_worker(secret, vocab.token_ids, args.step_ms)
    results: list[dict] = []
    answers: list = []
    print(f"synthetic step {args.step_ms:g} ms; max_tokens {args.max_tokens}; "
          f"{args.duration:g} s per phase; {os.cpu_count()} cores; "
          f"profile {'on' if args.profile else 'off'}")
    print("  ".join(COLUMNS))
    try:
        for grpc_server, count in itertools.product(args.grpc_server, args.router_processes):
            routers = start_routers(count, secret, worker.info["address"],
                                    "http" in args.fronts, args.profile, grpc_server)
            try:
                for front in args.fronts:
                    for streams in args.streams:
                        load = Load(front, streams, args.max_tokens, prompt, args.duration)
                        results.append({"routers": count, "grpc_server": grpc_server,
                                        **run_phase(load, routers, worker, vocab, args.step_ms)})
                        print(_row(results[-1]), flush=True)
            finally:
                answers += [r.stop() for r in routers]
    finally:
        worker.stop()
    for answer in answers:
        if answer and answer.get("profile"):
            print(answer["profile"])
    return results


if __name__ == "__main__":
    main()
