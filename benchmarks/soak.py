"""Soak: `pdserve up` at saturation with random cancels and aborts; does anything leak?

Starts `pdserve up` in a child process (its own Ray and Redis), warms it with `--warm-s` of
the load, records the baseline (the router process's RSS, every worker's used KV blocks),
then drives it closed loop at `--concurrency` for `--duration` seconds with `pdserve bench`'s
sender (sharegpt-like prompts; `--cancel-fraction` of the requests cancelled by the client and
`--abort-fraction` aborted through the router, each at a random point mid-stream). Every
`--sample-s` it prints the router's RSS against the requests finished so far; at the end the
slope of RSS per request over the second half of the load, then, once the service is idle
again, RSS before / peak / after, used blocks per worker before / after, and the requests'
outcomes. Exits 1 when a worker's used blocks are not back to the baseline, a worker is down,
or the router still holds requests.

    .venv/bin/python benchmarks/soak.py --duration 600                  # tiny model
    .venv/bin/python benchmarks/soak.py --model smollm2-135m --scale 0.5 --duration 600
    .venv/bin/python benchmarks/soak.py --address 127.0.0.1:50051 --router-pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

from pdserve.bench import interrupts, workloads
from pdserve.bench.runner import grpc_send
from pdserve.client import AsyncClient

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (tests/tiny_models.py's random "
                   "Llama), 'smollm2-135m' or an HF directory")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight, always")
    p.add_argument("--cancel-fraction", type=float, default=0.1)
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--scale", type=float, default=0.25,
                   help="sharegpt-like length scale (0.25: prompts <= 256, answers <= 128)")
    p.add_argument("--warm-s", type=float, default=15.0,
                   help="seconds of the same load before the baseline is taken")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--settle-s", type=float, default=60.0,
                   help="after the load: how long the service may take to go idle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", default=None, help="soak a running router instead")
    p.add_argument("--router-pid", type=int, default=None, help="with --address: its pid")
    p.add_argument("--up-args", default="", help="more `pdserve up` flags, e.g. "
                   "'--decode-tp 2 --prefill-workers 2'")
    p.add_argument("--json", default="bench-results/soak.json", help="'' to skip")
    args = p.parse_args()
    interrupts.check_fractions(args.cancel_fraction, args.abort_fraction)
    if (args.address is None) != (args.router_pid is None):
        p.error("--address and --router-pid go together")
    return args


# ---------------------------------------------------------------------------- the service


def model_dir(model: str, workdir: Path) -> str:
    if model != "tiny":
        return model
    sys.path.insert(0, str(REPO))  # tests/ is not installed
    from tests.tiny_models import write_tiny_model

    return str(write_tiny_model(workdir / "tiny-llama", "llama", seed=1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_up(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen, str]:
    """`pdserve up` in its own process group and Ray temp dir; (process, router address)."""
    model = model_dir(args.model, workdir)
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "pdserve"), "up", "--model", model,
           "--port", str(port), "--metrics-port", str(free_port()), "--http-port", "0",
           *(["--max-model-len", "512", "--num-kv-blocks", "1024"] if args.model == "tiny"
             else []), *args.up_args.split()]
    env = dict(os.environ, RAY_TMPDIR=str(workdir), RAY_USAGE_STATS_ENABLED="0")
    log = open(workdir / "pdserve-up.log", "wb")  # noqa: SIM115 (lives as long as the child)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    print(f"started {' '.join(cmd)} (pid {proc.pid}, log {workdir / 'pdserve-up.log'})")
    return proc, f"127.0.0.1:{port}"


def stop_up(proc: subprocess.Popen) -> None:
    """SIGINT (pdserve up stops what it started), SIGKILL its group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# ---------------------------------------------------------------------------- observing


async def snapshot(client: AsyncClient) -> dict:
    """Every worker's used blocks and whether it is up, and the router's requests."""
    stats = await client.stats(timeout=10)
    return {"blocks": {w.worker_id: w.num_used_blocks for w in stats.workers},
            "down": sorted(w.worker_id for w in stats.workers if not w.up),
            "inflight": stats.num_inflight + stats.num_queued}


async def settle(client: AsyncClient, blocks: dict | None, timeout: float) -> dict:
    """The first snapshot with every worker up, nothing in flight and these used blocks
    (None: 0 on every worker, the baseline of an idle service); else the last one after
    `timeout` seconds (the router's view of a worker's load lags it by ~0.2 s)."""
    end = time.monotonic() + timeout
    while True:
        snap = await snapshot(client)
        want = blocks if blocks is not None else dict.fromkeys(snap["blocks"], 0)
        idle = snap["blocks"] == want and not snap["down"] and not snap["inflight"]
        if idle or time.monotonic() > end:
            return snap
        await asyncio.sleep(0.5)


def slope(samples: list[dict], since: float) -> float:
    """Least-squares bytes of RSS per finished request over the samples from `since`."""
    pts = [(s["done"], s["rss"]) for s in samples if s["t"] >= since]
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        return float("nan")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


# ---------------------------------------------------------------------------- the load


def turns(args: argparse.Namespace, vocab_size: int, phase: str, seed: int):
    """An endless stream of (request id, turn): fresh sharegpt-like batches, interrupts
    planned per batch."""
    for batch in itertools.count():
        jobs = [[r] for r in workloads.sharegpt_like(256, vocab_size, seed + batch, args.scale)]
        jobs = interrupts.with_interrupts(jobs, args.cancel_fraction, args.abort_fraction,
                                          seed + batch)
        for i, (turn,) in enumerate(jobs):
            yield f"{phase}-{batch}-{i}", turn


async def load(client: AsyncClient, args: argparse.Namespace, vocab_size: int,
               outcomes: Counter, duration: float, phase: str = "soak") -> None:
    """Closed loop: `concurrency` senders, each sending the next turn until the deadline."""
    seed = args.seed + (0 if phase == "soak" else 1_000_000)  # the warm-up caches nothing
    send, source = grpc_send(client), turns(args, vocab_size, phase, seed)
    end = time.monotonic() + duration
    t0 = time.perf_counter()

    async def sender() -> None:
        while time.monotonic() < end:
            request_id, turn = next(source)
            record, _ = await send(request_id, turn, list(turn.prompt_token_ids), t0, 0.0,
                                   120.0)
            outcomes[record.interrupted or record.error or "ok"] += 1

    await asyncio.gather(*(sender() for _ in range(args.concurrency)))


async def sample(rss_of, outcomes: Counter, samples: list[dict], every: float) -> None:
    t0 = time.monotonic()
    while True:
        done = sum(outcomes.values())
        samples.append({"t": time.monotonic() - t0, "rss": rss_of(), "done": done})
        print(f"  t={samples[-1]['t']:6.1f} s  router RSS {samples[-1]['rss'] / MiB:8.1f} MiB"
              f"  requests finished {done}", flush=True)
        await asyncio.sleep(every)


# ---------------------------------------------------------------------------- the soak


async def wait_up(client: AsyncClient, router: psutil.Process, timeout: float) -> None:
    """Until the router serves; RuntimeError at once if its process exits first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not router.is_running() or router.status() == psutil.STATUS_ZOMBIE:
            raise RuntimeError("pdserve up exited before serving: see its log")
        try:
            await client.wait_ready(2)
            return
        except TimeoutError:
            pass
    raise TimeoutError(f"pdserve up not serving after {timeout:g} s")


async def soak(args: argparse.Namespace, address: str, router: psutil.Process) -> int:
    async with AsyncClient(address) as client:
        await wait_up(client, router, 600)
        vocab_size = (await client.model_info()).vocab_size
        # the same load, briefly: what the router allocates once is in the baseline
        await load(client, args, vocab_size, Counter(), args.warm_s, "warm")
        before = await settle(client, None, 30)
        rss_before = router.memory_info().rss
        print(f"baseline: router RSS {rss_before / MiB:.1f} MiB, used blocks {before['blocks']}")
        outcomes: Counter = Counter()
        samples: list[dict] = []
        sampler = asyncio.create_task(
            sample(lambda: router.memory_info().rss, outcomes, samples, args.sample_s))
        await load(client, args, vocab_size, outcomes, args.duration)
        after = await settle(client, before["blocks"], args.settle_s)
        await asyncio.sleep(args.sample_s)  # one more sample, idle
        sampler.cancel()
        rss_after = router.memory_info().rss
    per_request = slope(samples, args.duration / 2)
    report = {
        "rss_before": rss_before, "rss_peak": max(s["rss"] for s in samples),
        "rss_after": rss_after, "rss_slope_bytes_per_request": per_request,
        "blocks_before": before["blocks"], "blocks_after": after["blocks"],
        "down_after": after["down"], "inflight_after": after["inflight"],
        "outcomes": dict(outcomes), "samples": samples, "settings": vars(args),
    }
    return print_report(report, args.json)


def print_report(r: dict, path: str) -> int:
    print(f"router RSS before / peak / after: {r['rss_before'] / MiB:.1f} / "
          f"{r['rss_peak'] / MiB:.1f} / {r['rss_after'] / MiB:.1f} MiB")
    print(f"router RSS slope over the second half: {r['rss_slope_bytes_per_request']:.1f} "
          f"bytes per request")
    for worker in sorted(set(r["blocks_before"]) | set(r["blocks_after"])):
        print(f"used blocks {worker}: before {r['blocks_before'].get(worker)} after "
              f"{r['blocks_after'].get(worker)}")
    o = Counter(r["outcomes"])
    failed = {k: v for k, v in o.items() if k not in ("ok", "cancel", "abort")}
    print(f"requests: ok {o['ok']}, cancelled {o['cancel']}, aborted {o['abort']}, "
          f"failed {sum(failed.values())} {failed or ''}")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(r, indent=1) + "\n")
        print(f"wrote {path}")
    leaked = r["blocks_after"] != r["blocks_before"] or r["down_after"] or r["inflight_after"]
    if leaked:
        print(f"FAIL: not back to the baseline (workers down: {r['down_after']}, requests "
              f"still in the router: {r['inflight_after']})")
    return 1 if leaked else 0


def main() -> int:
    args = parse_args()
    if args.address is not None:
        return asyncio.run(soak(args, args.address, psutil.Process(args.router_pid)))
    with tempfile.TemporaryDirectory(prefix="pdsoak", dir="/tmp") as tmp:
        proc, address = start_up(args, Path(tmp))
        try:
            return asyncio.run(soak(args, address, psutil.Process(proc.pid)))
        finally:
            stop_up(proc)


if __name__ == "__main__":
    sys.exit(main())
