"""Disaggregated (1 prefill + 1 decode), colocated (2 workers that do both) and adaptive (1 + 1,
each prompt placed from measured costs), same CPU budget.

Every deployment runs through the same router and clients, with the same seeded workloads,
the same per-worker thread count and the same flags, the workload's SLO among them (`--slo`:
what adaptive placement weighs, and under which a decode step that prefills is sized to the
TPOT bound in every mode); only where prefill runs differs: always on the prefill worker but
for a short session tail (`--prefill-placement fixed`), always where the request decodes
(`--mode colocated`), or per request (`--prefill-placement adaptive`, the default). For each
workload and each offered rate it prints request throughput, TTFT / TPOT percentiles, SLO
attainment and goodput side by side, and adaptive's goodput against the better of the other
two, then writes one JSON, one markdown table and one PNG (latency CDFs, goodput vs rate) per
workload under --out. A service is started per mode and workload (its SLO is a flag).

With `--perf perf.json` (from `pdserve profile --threads <--threads>`) every cell is also run
through the planner's simulator, on the same arrivals and lengths, as the same shape
(pdserve.planner.shapes): its predicted TTFT and TPOT p50 / p90 beside the measured ones and
the error of each, which is how far the planner's sizing and `pdserve plan --shapes` can be
trusted on this machine.

    .venv/bin/python benchmarks/pd_vs_colocated.py                  # SmolLM2, every workload
    .venv/bin/python benchmarks/pd_vs_colocated.py --rates 0.5,1 --num-requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from pdserve.bench import arrivals, metrics, report, workloads
from pdserve.bench.runner import grpc_send, run_jobs
from pdserve.client import AsyncClient
from pdserve.launch.service import Service
from pdserve.launch.settings import ServeSettings
from pdserve.planner.perf_model import PerfModel
from pdserve.planner.shapes import Shape, simulate_shape
from pdserve.planner.traces import TraceRequest

# name: (input_len, output_len, SLO in ms). Sized for SmolLM2 on one thread of an AVX512-BF16
# EPYC core (alone: ~0.6 s for a 512-token prompt, ~12 ms a decode step), with the default
# rates from a load the single prefill worker keeps up with to twice what it can: on a slower
# host pass lower --rates.
WORKLOADS = {
    "prefill-heavy": (512, 8, "ttft=2000,tpot=100"),
    "decode-heavy": (64, 128, "ttft=500,tpot=50"),
    "mixed": (256, 32, "ttft=1000,tpot=75"),
}
SHAPES = {"disaggregated": Shape("disaggregated", 1, 1), "colocated": Shape("colocated", 0, 2),
          "adaptive": Shape("adaptive", 1, 1)}
MODES = {
    "disaggregated": {"mode": "disaggregated", "prefill_workers": 1, "decode_workers": 1,
                      "prefill_placement": "fixed"},
    "colocated": {"mode": "colocated", "decode_workers": 2},
    "adaptive": {"mode": "disaggregated", "prefill_workers": 1, "decode_workers": 1,
                 "prefill_placement": "adaptive"},
}
FIXED = ("disaggregated", "colocated")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--rates", default="1,2,4", help="offered requests/s")
    p.add_argument("--num-requests", type=int, default=24, help="per workload and rate")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/pd_vs_colocated")
    p.add_argument("--perf", default=None,
                   help="a perf model (pdserve profile): predict every cell in simulation too")
    return p.parse_args()


def jobs(n_in: int, n_out: int, num: int, vocab: int, seed: int) -> list:
    """Fresh random prompts for each rate: no run gets prefix-cache hits from another."""
    return [[r] for r in workloads.grid([n_in], [n_out], num, vocab, seed)]


async def run_mode(mode: str, name: str, args, rates: list[float]) -> dict:
    """One deployment serving one workload at each rate: {rate: (summary, records,
    predicted summary or None)}."""
    n_in, n_out, slo_text = WORKLOADS[name]
    settings = replace(
        ServeSettings(), model=args.model, prefill_threads=args.threads,
        decode_threads=args.threads, port=0, metrics_port=0, http_port=0, max_num_seqs=64,
        max_model_len=2048, kv_cache_memory_bytes=512 << 20, slo=slo_text, **MODES[mode],
    )
    service = Service(settings)
    await service.start()
    results: dict = {}
    try:
        async with AsyncClient(service.address) as client:
            vocab = (await client.model_info()).vocab_size
            warm = jobs(n_in, n_out, 2, vocab, 10**6 + args.seed)
            await run_jobs(grpc_send(client), warm, [0.0, 0.0], progress=False)
            for i, rate in enumerate(rates):  # the same prompts in every mode
                batch = jobs(n_in, n_out, args.num_requests, vocab, args.seed * 1000 + i)
                times = arrivals.poisson_times(len(batch), rate, 1.0, args.seed)
                records, duration = await run_jobs(grpc_send(client), batch, times,
                                                   progress=False)
                slo = metrics.parse_slo(slo_text)
                summary = metrics.summarize(records, duration, slo)
                predicted = None
                if args.perf:
                    trace = [TraceRequest(t, len(job[0].prompt_token_ids), job[0].output_len)
                             for t, job in zip(times, batch)]
                    predicted = simulate_shape(trace, SHAPES[mode],
                                               PerfModel.load(args.perf), slo)
                results[rate] = (summary, records, predicted)
                print(f"{mode:>13} {name:>13} {rate:>5g} req/s: goodput "
                      f"{summary.goodput:.3f}, TTFT p50 {summary.ttft.p50 * 1e3:.0f} ms, "
                      f"TPOT p50 {summary.tpot.p50 * 1e3:.0f} ms", flush=True)
    finally:
        await service.stop()
    return results


def table(results: dict, names: list[str], rates: list[float]) -> str:
    lines = []
    for name in names:
        slo = WORKLOADS[name][2]
        n_in, n_out = WORKLOADS[name][:2]
        lines += [f"\n### {name}: {n_in} prompt tokens, {n_out} output tokens, SLO {slo} (ms)\n",
                  "| rate | mode | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | "
                  "attained | goodput |", "|---|---|---|---|---|---|---|---|---|"]
        for rate in rates:
            for mode in MODES:
                s = results[mode][name][rate][0]
                lines.append(
                    f"| {rate:g} | {mode} | {s.request_throughput:.2f} | "
                    f"{s.ttft.p50 * 1e3:.0f} | {s.ttft.p99 * 1e3:.0f} | "
                    f"{s.tpot.p50 * 1e3:.1f} | {s.tpot.p99 * 1e3:.1f} | "
                    f"{s.slo_attainment:.0%} | {s.goodput:.2f} |")
    return "\n".join(lines)


def verdict(results: dict, names: list[str], rates: list[float], num_requests: int) -> str:
    """Adaptive's goodput against the better fixed mode's, per cell. One request more or less
    within the SLO moves a cell's goodput by about its throughput / num_requests: that is the
    resolution (the noise floor) of a cell."""
    lines = ["\n### adaptive vs the better of disaggregated and colocated (goodput, req/s)\n",
             "| workload | rate | adaptive | better fixed | difference | one request |",
             "|---|---|---|---|---|---|"]
    for name in names:
        for rate in rates:
            adaptive = results["adaptive"][name][rate][0]
            best = max((results[m][name][rate][0] for m in FIXED), key=lambda s: s.goodput)
            step = best.request_throughput / num_requests
            lines.append(f"| {name} | {rate:g} | {adaptive.goodput:.3f} | {best.goodput:.3f} | "
                         f"{adaptive.goodput - best.goodput:+.3f} | {step:.3f} |")
    return "\n".join(lines)


def prediction(results: dict, names: list[str], rates: list[float]) -> str:
    """Measured vs simulated TTFT and TPOT p50 / p90 per cell (ms), and per metric the median
    and worst error of the prediction over every cell, as a fraction of the measured value."""
    keys = [("TTFT p50", "ttft", "p50"), ("TTFT p90", "ttft", "p90"),
            ("TPOT p50", "tpot", "p50"), ("TPOT p90", "tpot", "p90")]
    lines = ["\n### the planner's simulator against the measured runs (ms: measured / predicted)"
             "\n", "| workload | rate | mode | " + " | ".join(k for k, _, _ in keys) + " |",
             "|---|---|---|" + "---|" * len(keys)]
    errors: dict[str, list[float]] = {k: [] for k, _, _ in keys}
    for name in names:
        for rate in rates:
            for mode in MODES:
                measured, _, predicted = results[mode][name][rate]
                cells = []
                for label, metric, q in keys:
                    m = getattr(getattr(measured, metric), q)
                    p = getattr(getattr(predicted, metric), q)
                    cells.append(f"{m * 1e3:.0f} / {p * 1e3:.0f}")
                    if m > 0 and math.isfinite(m) and math.isfinite(p):
                        errors[label].append(abs(p - m) / m)
                lines.append(f"| {name} | {rate:g} | {mode} | " + " | ".join(cells) + " |")
    lines += ["", "| error | " + " | ".join(k for k, _, _ in keys) + " |",
              "|---|" + "---|" * len(keys)]
    for label, pick in (("median", statistics.median), ("worst", max)):
        lines.append(f"| {label} | " + " | ".join(
            f"{pick(errors[k]):.0%}" if errors[k] else "-" for k, _, _ in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    names = args.workloads.split(",")
    started = time.time()
    results = {mode: {name: asyncio.run(run_mode(mode, name, args, rates)) for name in names}
               for mode in MODES}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = (f"CPU budget: {os.cpu_count()} cores, {args.threads} torch thread(s) per worker, "
            f"2 workers per mode; model {args.model}; {args.num_requests} requests per cell; "
            f"Poisson arrivals, seed {args.seed}\n" + table(results, names, rates)
            + "\n" + verdict(results, names, rates, args.num_requests)
            + ("\n" + prediction(results, names, rates) if args.perf else ""))
    print(text)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({
        "args": vars(args), "wall_s": time.time() - started,
        "results": {f"{mode}/{name}/{rate:g}": s.to_dict()
                    for mode, per in results.items() for name, cells in per.items()
                    for rate, (s, _, _) in cells.items()},
        "predicted": {f"{mode}/{name}/{rate:g}": p.to_dict()
                      for mode, per in results.items() for name, cells in per.items()
                      for rate, (_, _, p) in cells.items() if p is not None},
    }, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x)))
    for name in names:
        runs = [(f"{mode} {rate:g}/s", results[mode][name][rate][1])
                for mode in MODES for rate in rates]
        sweep = [(mode, [(rate, results[mode][name][rate][0]) for rate in rates])
                 for mode in MODES]
        report.plot(out / f"{name}.png", runs, sweep)
    print(f"wrote {out}/table.md, results.json and one PNG per workload")


if __name__ == "__main__":
    main()
