"""`pdserve bench`: load a running pdserve, print TTFT / ITL / TPOT / E2E percentiles, goodput.

    pdserve bench --workload sharegpt --num-requests 200 --rate 4 --slo ttft=500,tpot=50
    pdserve bench --workload grid --input-lens 128,1024 --output-lens 16,256 --rates 1,2,4,8
    pdserve bench --workload sessions --num-sessions 16 --turns 4 --concurrency 8
    pdserve bench --backend openai --base-url http://127.0.0.1:8000/v1   # any OpenAI server
    pdserve bench --concurrency 32 --cancel-fraction 0.1 --abort-fraction 0.1   # leak hunting

Arrivals: Poisson at `--rate` (gamma gaps with `--burstiness`; inf = all at once), a sweep of
rates (`--rates`), or a fixed `--concurrency` (closed loop). Writes `--json` and `--png`. When
the router's /metrics is reachable it also prints the router's own TTFT and ITL medians over
the run (the difference of two scrapes) beside the ones measured here, and, when the
deployment speculates, the acceptance rate and mean accepted length over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import urllib.request
from collections.abc import AsyncIterator

from pdserve import defaults
from pdserve.bench import arrivals, interrupts, metrics, report, workloads
from pdserve.bench.runner import Job, Send, grpc_send, run_jobs
from pdserve.bench.speculation import format_speculation, speculation_between
from pdserve.client.options import add_connection_args, connection_kwargs
from pdserve.router.metrics_text import quantile_between

ROUTER_HISTOGRAMS = {"ttft": "pdserve_time_to_first_token_seconds",
                     "itl": "pdserve_inter_token_latency_seconds"}
# The router copies workers' counters (speculation) from load reports, polled every 0.2 s and
# exported every 0.5 s: the scrape after a run waits this long to see the run's last steps.
WORKER_COUNTERS_LAG_S = 1.0


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark a running service", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["grpc", "openai"], default="grpc",
                   help="pdserve's gRPC API, or any OpenAI-compatible server's /v1/completions")
    p.add_argument("--address", default=defaults.ROUTER_ADDRESS, help="grpc: the router")
    p.add_argument("--connections", type=int, default=1,
                   help="grpc: TCP connections the streams take turns over (as many as the "
                        "service's --router-processes, or more, to load every router)")
    p.add_argument("--base-url", default=f"http://{defaults.HOST}:{defaults.HTTP_PORT}/v1",
                   help="openai: the API's base URL")
    p.add_argument("--model", default=None, help="openai: the model to ask for (default: the "
                                                 "first the server lists)")
    p.add_argument("--tokenizer", default="smollm2-135m",
                   help="openai: the served model's tokenizer (a directory or a bundled name): "
                        "its vocabulary bounds the random prompts")
    add_connection_args(p)  # API token (inline or file) and TLS, for both backends
    p.add_argument("--metrics-url", default=None,
                   help="the router's Prometheus endpoint ('' to skip the comparison)")
    p.add_argument("--workload", choices=["sharegpt", "grid", "sessions"], default="sharegpt")
    p.add_argument("--num-requests", type=int, default=100, help="sharegpt: requests")
    p.add_argument("--scale", type=float, default=1.0, help="sharegpt: length scale")
    p.add_argument("--input-lens", default="128,512", help="grid: prompt lengths")
    p.add_argument("--output-lens", default="32,128", help="grid: output lengths")
    p.add_argument("--num-per-cell", type=int, default=4, help="grid: requests per cell")
    p.add_argument("--num-sessions", type=int, default=16, help="sessions: conversations")
    p.add_argument("--turns", type=int, default=4, help="sessions: turns each")
    p.add_argument("--first-len", type=int, default=256, help="sessions: first prompt")
    p.add_argument("--turn-len", type=int, default=64, help="sessions: new tokens per turn")
    p.add_argument("--output-len", type=int, default=64, help="sessions: answer length")
    p.add_argument("--rate", type=float, default=math.inf, help="requests (jobs) per second")
    p.add_argument("--rates", default="", help="a sweep: comma-separated rates")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--concurrency", type=int, default=None, help="at most this many at once")
    p.add_argument("--slo", default="", help="e.g. ttft=500,tpot=50 (milliseconds)")
    p.add_argument("--cancel-fraction", type=float, default=0.0,
                   help="grpc: cancel this fraction of requests at a random point mid-stream "
                        "(counted apart, not as failures)")
    p.add_argument("--abort-fraction", type=float, default=0.0,
                   help="grpc: abort this fraction through the router's Abort RPC instead")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default="bench-results/bench.json", help="'' to skip")
    p.add_argument("--png", default="bench-results/bench.png", help="'' to skip")
    p.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    return asyncio.run(_bench(args))


def make_jobs(args: argparse.Namespace, vocab_size: int, seed: int) -> list[Job]:
    if args.workload == "sharegpt":
        return [[r] for r in workloads.sharegpt_like(args.num_requests, vocab_size, seed,
                                                     args.scale)]
    if args.workload == "grid":
        return [[r] for r in workloads.grid(_ints(args.input_lens), _ints(args.output_lens),
                                            args.num_per_cell, vocab_size, seed)]
    return workloads.sessions(args.num_sessions, args.turns, args.first_len, args.turn_len,
                              args.output_len, vocab_size, seed)


async def _bench(args: argparse.Namespace) -> int:
    slo = metrics.parse_slo(args.slo) if args.slo else None
    check_interrupts(args)
    rates = [float(r) for r in args.rates.split(",") if r] or [args.rate]
    if args.metrics_url is None:  # the router's own histograms, beside pdserve's gRPC API
        args.metrics_url = defaults.METRICS_URL if args.backend == "grpc" else ""
    async with _backend(args) as (send, vocab_size):
        runs, sweep, comparisons = [], [], []
        for i, rate in enumerate(rates):
            # each rate gets fresh prompts of the same distribution: no cache hits across runs
            jobs = interrupts.with_interrupts(make_jobs(args, vocab_size, args.seed + i),
                                              args.cancel_fraction, args.abort_fraction,
                                              args.seed + i)
            times = arrivals.poisson_times(len(jobs), rate, args.burstiness, args.seed)
            before = _scrape(args.metrics_url)
            records, duration = await run_jobs(send, jobs, times, args.concurrency,
                                               args.temperature, args.timeout,
                                               not args.no_progress)
            summary = metrics.summarize(records, duration, slo)
            label = f"{rate:g} req/s" if math.isfinite(rate) else "all at once"
            print(report.format_table(summary, title=f"pdserve bench: {args.workload}, {label}"))
            if args.metrics_url:
                await asyncio.sleep(WORKER_COUNTERS_LAG_S)
            after = _scrape(args.metrics_url)
            comparison = _compare(summary, before, after)
            for line in comparison.get("lines", []):
                print(line)
            if (speculation := speculation_between(before, after)) is not None:
                comparison["speculation"] = speculation.to_dict()
                print(format_speculation(speculation))
            runs.append((label, records))
            sweep.append((rate, summary))
            comparisons.append(comparison)
    if len(rates) > 1:
        print(report.format_sweep(sweep, title=f"pdserve bench sweep: {args.workload}"))
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    if args.json:
        report.write_json(args.json, settings, sweep, runs, comparisons)
        print(f"wrote {args.json}")
    if args.png:
        report.plot(args.png, runs, [("pdserve", sweep)] if len(rates) > 1 else None)
        print(f"wrote {args.png}")
    return 0


def check_interrupts(args: argparse.Namespace) -> None:
    """ValueError unless --cancel-fraction / --abort-fraction are valid for the backend."""
    interrupts.check_fractions(args.cancel_fraction, args.abort_fraction)
    if args.backend != "grpc" and (args.cancel_fraction or args.abort_fraction):
        raise ValueError("--cancel-fraction and --abort-fraction need --backend grpc (the "
                         "OpenAI API has no Abort, and its sender does not cut streams)")


@contextlib.asynccontextmanager
async def _backend(args: argparse.Namespace) -> AsyncIterator[tuple[Send, int]]:
    """The turn sender for `--backend`, and the vocabulary size prompts are drawn from."""
    conn = connection_kwargs(args)
    if args.backend == "openai":
        from pdserve.bench.openai_backend import OpenAIBackend
        from pdserve.engine.default_model import resolve_model
        from pdserve.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model(args.tokenizer))
        async with OpenAIBackend(args.base_url, tokenizer, conn["api_token"], args.model,
                                 conn["tls"]) as api:
            served = await api.wait_ready(60)
            api.model = served.name
            yield api.send, served.vocab_size
        return
    from pdserve.client import AsyncClient

    async with AsyncClient(args.address, connections=args.connections, **conn) as client:
        await client.wait_ready(60)
        yield grpc_send(client), (await client.model_info()).vocab_size


def _scrape(url: str) -> str | None:
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def _compare(summary: metrics.Summary, before: str | None, after: str | None) -> dict:
    """The router's TTFT / ITL medians over the run beside the ones measured here."""
    if before is None or after is None:
        return {}
    out: dict = {"lines": []}
    for key, name in ROUTER_HISTOGRAMS.items():
        router_p50 = quantile_between(before, after, name, 0.5)
        measured = getattr(summary, key).p50
        diff = (router_p50 - measured) / measured if measured else math.nan
        out[key] = {"router_p50_s": router_p50, "client_p50_s": measured, "diff": diff}
        out["lines"].append(f"router histogram {key} p50 {router_p50 * 1e3:.2f} ms vs measured "
                            f"{measured * 1e3:.2f} ms ({diff:+.1%})")
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]
