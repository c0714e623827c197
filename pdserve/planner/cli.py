"""`pdserve plan` and `pdserve profile`.

    pdserve profile --model M --threads 1 --out perf.json
    pdserve plan --policy deploy/policies/default.yaml --policy deploy/policies/aggressive.yaml \
        --trace bursty --perf perf.json --png bench-results/plan.png
    pdserve plan --shapes 2 --perf perf.json --rates 0.5,1,2,4 --input-len 512 \
        --output-len 8 --slo ttft=2000,tpot=100

`plan --shapes N` simulates N workers colocated, and split P:D with prompts on the prefill pool
or placed per request as the router does (pdserve.planner.shapes), at each rate of a steady
trace, and prints each one's goodput at the SLO, the best shape per rate and the loads where
the best turns from colocated to split or back (the crossover). `plan --policy`
simulates each policy on one trace (steady or bursty Poisson, or a JSON file: a list of
[arrival_s, input_tokens, output_tokens] or a `pdserve bench --json` result) with the
performance model from `profile`, and prints SLO attainment, p90 latencies, worker-hours,
cost and the replica range per policy. Wire-up: `add_parsers(sub)` on the `pdserve`
subparsers, then `main(args)` when args.command is "plan" or "profile".
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.metrics import SLO, format_slo, parse_slo
from pdserve.planner.evaluation import PlanSummary, evaluate
from pdserve.planner.perf_model import PerfModel
from pdserve.planner.policy import load_policy
from pdserve.planner.shapes import Cell, best, crossovers, sweep
from pdserve.planner.simulator import SimConfig, SimResult, simulate
from pdserve.planner.traces import TraceRequest, bursty_trace, load_trace, steady_trace

logger = logging.getLogger(__name__)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def add_parsers(sub) -> None:
    """Register `plan` and `profile` on an argparse subparsers object."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("plan", help="compare autoscaling policies in simulation",
                       description=__doc__, formatter_class=fmt)
    p.add_argument("--policy", action="append", help="a policy YAML (repeat)")
    p.add_argument("--shapes", type=int, default=None, metavar="N",
                   help="compare deployment shapes of N workers instead of policies")
    p.add_argument("--rates", default="0.5,1,2,4", help="--shapes: offered req/s to sweep")
    p.add_argument("--trace", default="steady", help="steady | bursty | a JSON trace file")
    p.add_argument("--perf", required=True, help="a PerfModel JSON from `pdserve profile`")
    p.add_argument("--rate", type=float, default=1.0, help="steady/bursty: base req/s")
    p.add_argument("--duration", type=float, default=600.0, help="steady/bursty: seconds")
    p.add_argument("--input-len", type=int, default=256, help="steady/bursty: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="steady/bursty: output tokens")
    p.add_argument("--spike-factor", type=float, default=4.0, help="bursty: rate multiplier")
    p.add_argument("--spike-start", type=float, default=None, help="bursty: s (duration / 3)")
    p.add_argument("--spike-len", type=float, default=None, help="bursty: s (duration / 6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-delay", type=float, default=30.0,
                   help="seconds before a new worker serves")
    p.add_argument("--kv-capacity", type=int, default=None,
                   help="KV tokens per decode worker (for the observed kv_usage)")
    p.add_argument("--slo", default="",
                   help="judge every policy by this SLO, e.g. ttft=2000,tpot=200 (ms); "
                        "default: the first policy's targets")
    p.add_argument("--png", default="", help="replica counts over time per policy")
    q = sub.add_parser("profile", help="measure the engine, write a PerfModel JSON",
                       description=__doc__, formatter_class=fmt)
    q.add_argument("--model", default=None, help="HF directory or known name (default bundled)")
    q.add_argument("--threads", type=int, default=1, help="torch threads (one worker's share)")
    q.add_argument("--out", default="perf.json")
    q.add_argument("--prefill-lens", type=_ints, default=(128, 512))
    q.add_argument("--batch-sizes", type=_ints, default=(1, 8))
    q.add_argument("--contexts", type=_ints, default=(64, 256))
    q.add_argument("--decode-steps", type=int, default=4, help="timed steps per cell")
    q.add_argument("--repeats", type=int, default=1, help="prefill runs per length")
    q.add_argument("--device", default="cpu")
    q.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    if args.command == "profile":
        return _profile(args)
    if args.command == "plan":
        return _plan(args)
    raise ValueError(f"planner CLI: unknown command {args.command!r}")


def _profile(args: argparse.Namespace) -> int:
    from pdserve.engine.default_model import DEFAULT_MODEL
    from pdserve.llm import LLM
    from pdserve.planner.profile import profile

    model = args.model or DEFAULT_MODEL
    llm = LLM(model=model, num_threads=args.threads, device=args.device, seed=args.seed)
    perf = profile(llm, args.prefill_lens, args.batch_sizes, args.contexts, args.decode_steps,
                   args.repeats, args.seed,
                   source={"model": str(model), "threads": args.threads, "device": args.device})
    perf.save(args.out)
    print(f"prefill: {perf.prefill_tokens_per_s:.1f} tokens/s per worker")
    print(f"decode step: {perf.decode_a_s * 1e3:.3f} ms + {perf.decode_b_s * 1e3:.4f} ms x batch"
          f" + {perf.decode_c_s * 1e6:.5f} us x batch x context")
    print(f"({args.threads} thread(s), {args.device}) -> {args.out}")
    return 0


def _trace(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace == "steady":
        return steady_trace(args.rate, args.duration, args.input_len, args.output_len, args.seed)
    if args.trace == "bursty":
        return bursty_trace(args.rate, args.duration, args.input_len, args.output_len,
                            args.spike_factor, args.spike_start, args.spike_len, args.seed)
    if not Path(args.trace).is_file():
        raise ValueError(f"--trace: {args.trace!r} is neither steady, bursty nor a file")
    return load_trace(args.trace)


def _plan(args: argparse.Namespace) -> int:
    if args.shapes is not None:
        return _plan_shapes(args)
    if not args.policy:
        raise ValueError("plan needs --policy (one or more) or --shapes N")
    policies = [load_policy(path) for path in args.policy]
    perf = PerfModel.load(args.perf)
    trace = _trace(args)
    if not trace:
        raise ValueError("the trace has no requests; raise --rate or --duration")
    slo = parse_slo(args.slo) if args.slo else SLO(policies[0].ttft_target_s,
                                                   policies[0].itl_target_s)
    config = SimConfig(startup_delay_s=args.startup_delay, kv_capacity_tokens=args.kv_capacity)
    results = [simulate(trace, policy, perf, config) for policy in policies]
    span = trace[-1].arrival_s
    print(f"trace {args.trace}: {len(trace)} requests over {span:.0f} s; SLO (ms) "
          f"{format_slo(slo)}; startup delay {args.startup_delay:g} s")
    print(format_comparison([evaluate(r, slo) for r in results]))
    if args.png:
        plot_replicas(args.png, results, trace)
        print(f"wrote {args.png}")
    return 0


def _plan_shapes(args: argparse.Namespace) -> int:
    if not args.slo:
        raise ValueError("--shapes needs --slo: goodput counts the requests that meet it")
    slo = parse_slo(args.slo)
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--rates: expected comma-separated req/s, got {args.rates!r}") from None
    if not rates or min(rates) <= 0:
        raise ValueError(f"--rates: expected positive req/s, got {args.rates!r}")
    cells = sweep(PerfModel.load(args.perf), args.shapes, rates, args.duration, args.input_len,
                  args.output_len, slo, args.seed)
    print(f"{args.shapes} workers; steady Poisson trace, {args.duration:g} s per rate, "
          f"{args.input_len} prompt / {args.output_len} output tokens; SLO (ms) "
          f"{format_slo(slo)}")
    print(format_shapes(cells))
    return 0


def format_shapes(cells: Sequence[Cell]) -> str:
    """Goodput (req/s) per shape and rate, the best shape per rate, and the crossovers."""
    names = list(dict.fromkeys(c.shape.name for c in cells))
    rates = sorted({c.rate for c in cells})
    width = max(len(n) for n in names) + 2
    lines = [f"{'req/s':>7}" + "".join(f"{n:>{width}}" for n in names) + "   best"]
    for rate in rates:
        goodput = {c.shape.name: c.summary.goodput or 0.0 for c in cells if c.rate == rate}
        lines.append(f"{rate:>7g}" + "".join(f"{goodput[n]:>{width}.3f}" for n in names)
                     + f"   {best(cells, rate).shape.name}")
    changes = crossovers(cells)
    if not changes:
        kind = "split" if best(cells, rates[0]).shape.split else "colocated"
        lines.append(f"no crossover: a {kind} shape is best at every rate swept")
    for before, after, top in changes:
        lines.append(f"crossover between {before:g} and {after:g} req/s: from {after:g} on, "
                     f"{top.shape.name} is best")
    return "\n".join(lines)


_COLS = (("policy", 14), ("TTFT ok%", 9), ("ITL ok%", 8), ("both%", 7), ("TTFT p90", 9),
         ("ITL p90", 8), ("worker-h", 9), ("cost", 8), ("prefill", 8), ("decode", 8))


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.1f}"


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}"


def format_comparison(summaries: Sequence[PlanSummary]) -> str:
    """One row per policy; latencies in ms, replica ranges as min-max."""
    lines = ["".join(f"{name:>{w}}" for name, w in _COLS)]
    for s in summaries:
        cells = (s.name[:13], _pct(s.ttft_attainment), _pct(s.itl_attainment),
                 _pct(s.attainment), _ms(s.ttft_p90_s), _ms(s.itl_p90_s),
                 f"{s.worker_hours:.2f}", f"{s.cost:.2f}", "{}-{}".format(*s.prefill_range),
                 "{}-{}".format(*s.decode_range))
        lines.append("".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLS)))
    return "\n".join(lines)


def plot_replicas(path: str | Path, results: Sequence[SimResult],
                  trace: Sequence[TraceRequest], bin_s: float = 10.0) -> None:
    """A PNG: the offered rate, then prefill and decode target replicas over time per policy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_rate, ax_p, ax_d = fig.subplots(3, 1, sharex=True)
    end = max(r.duration_s for r in results)
    bins = [0] * (int(end // bin_s) + 1)
    for req in trace:
        bins[int(req.arrival_s // bin_s)] += 1
    ax_rate.step([i * bin_s for i in range(len(bins))], [n / bin_s for n in bins], where="post")
    ax_rate.set_ylabel(f"arrivals (req/s, {bin_s:g} s bins)")
    for ax, role in ((ax_p, "prefill"), (ax_d, "decode")):
        for r in results:
            times = [pt.time_s for pt in r.timeline] + [r.duration_s]
            counts = [getattr(pt, role) for pt in r.timeline]
            ax.step(times, counts + counts[-1:], where="post", label=r.policy.name)
        ax.set_ylabel(f"{role} workers (target)")
        ax.legend(fontsize="small")
    for ax in (ax_rate, ax_p, ax_d):
        ax.grid(True, alpha=0.3)
    ax_d.set_xlabel("time (s)")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), format="png", dpi=100)
    logger.info("wrote %s", path)
