"""Multi-turn chat sessions against a small device KV pool: KV cache tiers off vs on.

Each session is a chat over the OpenAI chat completions API (streamed, greedy): every turn
appends a user message of ~`--turn-tokens` tokens of seeded pseudo-random words to the
history, and the assistant's reply (at most `--max-tokens`) is appended before the next turn;
TTFT is the time to the first non-empty content delta.
`--concurrency` client tasks run a closed loop over a FIFO of ready sessions (a session's next
turn queues behind every other session's), so between two turns of one session all the others
take a turn: with the sessions' histories ~`--pool-ratio` times the device pool, the device
prefix cache alone (LRU) keeps little of a session by its next turn, while the tiers below it
(`pdserve up --kv-host-bytes`, `--kv-disk-path`/`--kv-disk-bytes`) keep it all.

Turns carry no session id: every prompt goes to the prefill worker (the router's conditional
disaggregation only prefills a session's turn on its decode worker), so the prefill workers'
`pdserve_worker_computed_tokens_total` over the run is every prompt token that was computed
rather than served from a cache tier.

The same invocation starts `pdserve up` (1 prefill + 1 decode worker, `--num-kv-blocks` sized
from the working set) fresh for each configuration: tiers off; a host tier holding twice the
working set; with `--disk`, also a host tier of one device pool over a disk tier in a temporary
directory. Reported per configuration: TTFT p50/p99 of turn 1 and of turns 2+, prefill tokens
computed, tier hits (blocks, from the router's /metrics), wall time, output tok/s; the ratios
off / on; and how many replies differ from the tiers-off run's (greedy: expect 0).

    .venv/bin/python benchmarks/multi_turn.py                       # 64 sessions x 8 turns
    .venv/bin/python benchmarks/multi_turn.py --sessions 16 --turns 3 --concurrency 4 --disk

Why one file: a benchmark is one script a user reads and runs; its workload, sizing, client and
report go top to bottom, and nothing else imports them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

# Run as a script, sys.path[0] is benchmarks/, whose kernels.py would shadow Hugging Face's
# `kernels` package for transformers.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pdserve.bench import metrics  # noqa: E402
from pdserve.bench.cli import WORKER_COUNTERS_LAG_S  # noqa: E402
from pdserve.bench.openai_backend import OpenAIBackend  # noqa: E402
from pdserve.bench.trace import RequestRecord  # noqa: E402

BLOCK_SIZE = 16
COMPUTED = "pdserve_worker_computed_tokens_total"
TIER_HITS = "pdserve_kv_tier_hits_total"
POOL_BLOCKS = "pdserve_kv_blocks_total"


def _sibling(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported by its path (its folder stays off sys.path)."""
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


serving = _sibling("serving_vs_vllm")  # free_port(), server(): `pdserve up` as a subprocess


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a name pdserve knows or a dir")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker (default: pdserve up's own split)")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=200, help="tokens of each user message")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24, help="of each reply")
    p.add_argument("--pool-ratio", type=float, default=4.0,
                   help="the sessions' histories over the device KV pool")
    p.add_argument("--kv-transfer-timeout-s", type=float, default=600.0,
                   help="pdserve up's deadline of a prompt's prefill + KV transfer (its "
                        "default, 30 s, expires in the tiers-off queue at the default shape)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disk", action="store_true",
                   help="also run a small host tier over a disk tier")
    p.add_argument("--out", default="bench-results/multi_turn.json")
    return p.parse_args()


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), "unknown")


# ---------------------------------------------------------------------------- the workload


def block_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of one KV block: layers x (K, V) x kv heads x head dim x block size x element."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    element = 4 if dtype == "float32" else 2
    return (c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * BLOCK_SIZE
            * element)


def word_list(tokenizer) -> list[str]:
    """Words that are one token each after a space (' the', ' house', ...), in a fixed order."""
    pieces = sorted(t for t in tokenizer.get_vocab() if re.fullmatch(r"Ġ[a-z]{3,10}", t))
    return [tokenizer.convert_tokens_to_string([t]) for t in pieces]


def user_text(tokenizer, words: list[str], rng: random.Random, n: int) -> str:
    """Random words that tokenize to exactly `n` tokens (or the first count past it)."""
    chosen = [rng.choice(words) for _ in range(n)]

    def count() -> int:
        return len(tokenizer("".join(chosen).strip(), add_special_tokens=False).input_ids)

    while count() > n and len(chosen) > 1:
        chosen.pop()
    while count() < n:
        chosen.append(rng.choice(words))
    return "".join(chosen).strip()


def make_sessions(tokenizer, args: argparse.Namespace) -> list[list[str]]:
    """The user messages: sessions x turns, seeded."""
    words, rng = word_list(tokenizer), random.Random(args.seed)
    return [[user_text(tokenizer, words, rng, args.turn_tokens) for _ in range(args.turns)]
            for _ in range(args.sessions)]


def conversation(users: list[str], replies: list[str]) -> list[dict]:
    """The chat so far: user, assistant, user, ..., ending with the last user message."""
    messages = []
    for i, text in enumerate(users):
        messages.append({"role": "user", "content": text})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return messages


def history_tokens(tokenizer, users: list[str], reply: str) -> int:
    """Tokens of a session's whole chat, every reply taken as `reply`, the last one included."""
    ids = tokenizer.apply_chat_template(conversation(users, [reply] * len(users)),
                                        tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # BatchEncoding or a list


# ---------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """The device pool and the tiers, sized from the working set."""

    block_bytes: int
    working_set_blocks: int  # every session's whole chat, replies at max_tokens
    max_session_tokens: int
    pool_blocks: int

    @property
    def working_set_bytes(self) -> int:
        return self.working_set_blocks * self.block_bytes

    def configs(self, disk: bool, disk_dir: str) -> dict[str, list[str]]:
        """Name -> the `pdserve up` flags of its tiers."""
        out = {"tiers off": [],
               "host tier": ["--kv-host-bytes", str(2 * self.working_set_bytes)]}
        if disk:
            out["host + disk"] = ["--kv-host-bytes", str(self.pool_blocks * self.block_bytes),
                                  "--kv-disk-path", disk_dir,
                                  "--kv-disk-bytes", str(2 * self.working_set_bytes)]
        return out


def make_plan(tokenizer, sessions: list[list[str]], args: argparse.Namespace,
              model_dir: Path) -> Plan:
    words = word_list(tokenizer)
    reply = user_text(tokenizer, words, random.Random(-1), args.max_tokens)
    lengths = [history_tokens(tokenizer, users, reply) for users in sessions]
    ws_blocks = sum(math.ceil(n / BLOCK_SIZE) for n in lengths)
    return Plan(block_bytes(model_dir, args.dtype), ws_blocks, max(lengths),
                max(1, math.ceil(ws_blocks / args.pool_ratio)))


def server_argv(args: argparse.Namespace, model_dir: Path, plan: Plan, tiers: list[str],
                http_port: int, metrics_port: int) -> list[str]:
    threads = ([] if args.threads is None else
               ["--prefill-threads", str(args.threads), "--decode-threads", str(args.threads)])
    max_len = 256 * math.ceil((plan.max_session_tokens + 64) / 256)
    return [str(serving.ROOT / ".venv" / "bin" / "pdserve"), "up", "--model", str(model_dir),
            "--dtype", args.dtype, "--http-port", str(http_port),
            "--port", str(serving.free_port()), "--metrics-port", str(metrics_port),
            "--max-model-len", str(max_len), "--block-size", str(BLOCK_SIZE),
            "--num-kv-blocks", str(plan.pool_blocks),
            "--kv-transfer-timeout-s", f"{args.kv_transfer_timeout_s:g}", *threads, *tiers]


# ---------------------------------------------------------------------------- the client


@dataclass(frozen=True)
class Turn:
    session: int
    turn: int  # 1-based
    record: RequestRecord
    reply: str
    total_tokens: int  # prompt + completion, from the usage


async def chat_turn(backend: OpenAIBackend, request_id: str, messages: list[dict],
                    max_tokens: int, t0: float) -> tuple[RequestRecord, str, int]:
    """One streamed chat completion: its record (a token per content delta, as
    OpenAIBackend counts), the reply and the prompt + completion tokens."""
    body = {"model": backend.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    times, text, usage, error = [], [], {}, None
    sent = time.perf_counter() - t0
    try:
        async with backend.http.stream("POST", f"{backend.base_url}/chat/completions",
                                       json=body, timeout=600) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP_{reply.status_code}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                delta = ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content")
                if delta:
                    times.append(time.perf_counter() - t0)
                    text.append(delta)
                usage.update(chunk.get("usage") or {})
    except Exception as exc:  # noqa: BLE001 - the record keeps why; the session stops
        error = str(exc) or type(exc).__name__
    counts = [1] * len(times)
    if counts and usage.get("completion_tokens", 0) > len(times):
        counts[-1] += usage["completion_tokens"] - len(times)
    record = RequestRecord(request_id, sent, time.perf_counter() - t0, tuple(times),
                           tuple(counts), usage.get("prompt_tokens", 0), error,
                           (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return record, "".join(text), usage.get("total_tokens", 0)


async def drive(backend: OpenAIBackend, sessions: list[list[str]],
                args: argparse.Namespace) -> tuple[list[Turn], float]:
    """Closed loop: `concurrency` tasks take the next ready session from a FIFO."""
    ready: asyncio.Queue[int | None] = asyncio.Queue()
    for s in range(len(sessions)):
        ready.put_nowait(s)
    replies: list[list[str]] = [[] for _ in sessions]
    turns: list[Turn] = []
    left = [len(sessions)]
    t0 = time.perf_counter()

    async def client() -> None:
        while (s := await ready.get()) is not None:
            t = len(replies[s])
            messages = conversation(sessions[s][:t + 1], replies[s])
            record, reply, total = await chat_turn(backend, f"s{s}-t{t + 1}", messages,
                                                   args.max_tokens, t0)
            turns.append(Turn(s, t + 1, record, reply, total))
            replies[s].append(reply)
            if record.ok and t + 1 < len(sessions[s]):
                ready.put_nowait(s)
                continue
            left[0] -= 1
            if not left[0]:
                for _ in range(args.concurrency):
                    ready.put_nowait(None)

    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return turns, time.perf_counter() - t0


# ---------------------------------------------------------------------------- /metrics


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def samples(text: str, name: str) -> dict[tuple, float]:
    """Sample value by its sorted label items."""
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def increase(before: str, after: str, name: str) -> dict[tuple, float]:
    """Per series: after - before (after alone when the counter was reset)."""
    start = samples(before, name)
    return {k: v - start.get(k, 0.0) if v >= start.get(k, 0.0) else v
            for k, v in samples(after, name).items()}


def counters(before: str, after: str) -> dict:
    computed = {dict(k).get("worker", ""): v for k, v in increase(before, after, COMPUTED).items()}
    hits, per_tier = increase(before, after, TIER_HITS), {}
    for k, v in hits.items():  # a disk hit counts under host too (router/metrics_kv_tiers.py)
        tier = dict(k).get("tier", "")
        per_tier[tier] = per_tier.get(tier, 0.0) + v
    by_worker = {"/".join(v for _, v in k): n for k, n in hits.items()}  # "host/prefill-0"
    pools = {dict(k).get("worker", ""): v for k, v in samples(after, POOL_BLOCKS).items()}
    return {"computed_tokens": computed, "tier_hit_blocks": per_tier,
            "tier_hit_blocks_by_worker": by_worker, "pool_blocks": pools,
            "prefill_tokens": sum(v for w, v in computed.items() if w.startswith("prefill"))}


# ---------------------------------------------------------------------------- one configuration


async def measure(args: argparse.Namespace, sessions: list[list[str]], tokenizer,
                  http_port: int, metrics_url: str, proc) -> tuple[list[Turn], float, dict]:
    async with OpenAIBackend(f"http://127.0.0.1:{http_port}/v1", tokenizer) as backend:
        backend.model = (await backend.wait_ready(600, alive=lambda: proc.poll() is None)).name
        warm = [{"role": "user", "content": "Say hello."}]
        await chat_turn(backend, "warm-up", warm, 4, time.perf_counter())
        await asyncio.sleep(WORKER_COUNTERS_LAG_S)
        before = scrape(metrics_url)
        turns, duration = await drive(backend, sessions, args)
        await asyncio.sleep(2 * WORKER_COUNTERS_LAG_S)
        return turns, duration, counters(before, scrape(metrics_url))


def run_config(name: str, tiers: list[str], args: argparse.Namespace, model_dir: Path,
               plan: Plan, sessions: list[list[str]], tokenizer) -> dict:
    http_port, metrics_port = serving.free_port(), serving.free_port()
    argv = server_argv(args, model_dir, plan, tiers, http_port, metrics_port)
    log = Path(args.out).with_suffix("") / f"{name.replace(' ', '_').replace('+', '')}.log"
    print(f"== {name}: {' '.join(argv[2:])}", flush=True)
    with serving.server(argv, dict(os.environ), log) as proc:
        turns, duration, seen = asyncio.run(measure(
            args, sessions, tokenizer, http_port, f"http://127.0.0.1:{metrics_port}/metrics",
            proc))
    result = summarize(turns, duration, seen)
    print(f"   {name}: {duration:.0f} s, TTFT p50 turns 2+ {_ms(result['ttft_later']['p50'])} "
          f"ms, prefill tokens {result['prefill_tokens']:.0f}, errors {result['errors']}",
          flush=True)
    return {**result, "turns": turns}


def summarize(turns: list[Turn], duration: float, seen: dict) -> dict:
    ok = [t for t in turns if t.record.ok]

    def ttft(first: bool) -> dict:
        values = [metrics.ttft(t.record) for t in ok if (t.turn == 1) == first]
        stats = metrics.latency_stats([v for v in values if v is not None])
        return {"p50": stats.p50, "p99": stats.p99, "n": len(values)}

    summary = metrics.summarize([t.record for t in turns], duration, None)
    return {"ttft_turn1": ttft(True), "ttft_later": ttft(False), "wall_s": duration,
            "output_tok_s": summary.output_token_throughput, "errors": summary.num_errors,
            "cached_tokens_reported": summary.total_cached_tokens, **seen}


# ---------------------------------------------------------------------------- the report


def mismatches(base: list[Turn], other: list[Turn]) -> dict:
    """Replies (session, turn) that differ from the baseline's, and the sessions affected."""
    ref = {(t.session, t.turn): t.reply for t in base if t.record.ok}
    mine = {(t.session, t.turn): t.reply for t in other if t.record.ok and
            (t.session, t.turn) in ref}
    diff = sorted(k for k, reply in mine.items() if ref[k] != reply)
    compared = len(mine)
    first = {}
    for s, turn in diff:
        first.setdefault(s, turn)
    return {"replies_compared": compared, "replies_differing": len(diff),
            "first_differing_turn_by_session": first}


def table(results: dict) -> str:
    lines = ["| tiers | TTFT p50 turn 1 | TTFT p99 turn 1 | TTFT p50 turns 2+ | "
             "TTFT p99 turns 2+ | prefill tokens computed | tier hits prefill (blocks) | "
             "tier hits decode (blocks) | wall s | out tok/s | replies differing |",
             "|---|" + "---|" * 10]
    for name, r in results.items():
        hits = {role: ", ".join(f"{key.split('/')[0]} {n:,.0f}" for key, n in sorted(
            r["tier_hit_blocks_by_worker"].items()) if n and role in key) or "-"
            for role in ("prefill", "decode")}
        differ = r.get("mismatch")
        lines.append(
            f"| {name} | {_ms(r['ttft_turn1']['p50'])} | {_ms(r['ttft_turn1']['p99'])} | "
            f"{_ms(r['ttft_later']['p50'])} | {_ms(r['ttft_later']['p99'])} | "
            f"{r['prefill_tokens']:,.0f} | {hits['prefill']} | {hits['decode']} | "
            f"{r['wall_s']:.0f} | "
            f"{r['output_tok_s']:.1f} | "
            f"{'-' if differ is None else f'{differ[0]} of {differ[1]}'} |")
    return "\n".join(lines)


def ratios(results: dict) -> dict:
    off = results["tiers off"]
    return {name: {"ttft_p50_later": off["ttft_later"]["p50"] / r["ttft_later"]["p50"],
                   "prefill_tokens": off["prefill_tokens"] / max(r["prefill_tokens"], 1)}
            for name, r in results.items() if name != "tiers off"}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.0f}"


def header(args: argparse.Namespace, plan: Plan) -> str:
    return (f"CPU: {cpu_name()} ({os.cpu_count()} cores); model {args.model}, {args.dtype}; "
            f"{args.sessions} sessions x {args.turns} turns of {args.turn_tokens} tokens, "
            f"replies <= {args.max_tokens} tokens, concurrency {args.concurrency}, seed "
            f"{args.seed}\ndevice pool {plan.pool_blocks} blocks of {BLOCK_SIZE} tokens "
            f"({plan.pool_blocks * plan.block_bytes / 2**20:.0f} MiB, "
            f"{plan.block_bytes} B a block) per worker; working set (every session's whole "
            f"chat, replies at max length) {plan.working_set_blocks} blocks = "
            f"{plan.working_set_blocks / plan.pool_blocks:.2f}x the pool")


def report(args: argparse.Namespace, plan: Plan, results: dict, started: float) -> None:
    base = results["tiers off"]["turns"]
    for name, r in results.items():
        if name != "tiers off":
            m = mismatches(base, r["turns"])
            r["mismatch"] = (m["replies_differing"], m["replies_compared"])
            r["mismatch_detail"] = m
    actual = sum(math.ceil(max(t.total_tokens for t in base if t.session == s) / BLOCK_SIZE)
                 for s in {t.session for t in base})
    text = (header(args, plan) + f"; measured (tiers off): {actual} blocks = "
            f"{actual / plan.pool_blocks:.2f}x\n\n" + table(results) + "\n"
            "(TTFT in ms; a disk hit counts under host too, as the router counts them; the "
            "decode worker's hits are prompt blocks it did not need shipped)\n")
    for name, q in ratios(results).items():
        text += (f"\n{name}: tiers off / on = {q['ttft_p50_later']:.2f}x TTFT p50 (turns 2+), "
                 f"{q['prefill_tokens']:.2f}x prefill tokens computed")
    print(text)
    write_json(Path(args.out), {
        "args": vars(args), "cpu": cpu_name(), "plan": vars(plan) | {"measured_blocks": actual},
        "wall_s": time.time() - started, "ratios": ratios(results), "table": table(results),
        "results": {name: {k: v for k, v in r.items() if k != "turns"}
                    | {"replies": replies(r["turns"])} for name, r in results.items()}})


def replies(turns: list[Turn]) -> list[dict]:
    return [{"session": t.session, "turn": t.turn, "reply": t.reply,
             "ttft_s": metrics.ttft(t.record), "e2e_s": metrics.e2e(t.record),
             "prompt_tokens": t.record.num_prompt_tokens,
             "cached_tokens": t.record.cached_tokens, "error": t.record.error}
            for t in sorted(turns, key=lambda t: (t.session, t.turn))]


def write_json(out: Path, data: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=lambda x: None if isinstance(
        x, float) and math.isnan(x) else str(x)))
    print(f"\nwrote {out}")


def main() -> None:
    from pdserve.engine.default_model import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    args = parse_args()
    started = time.time()
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    sessions = make_sessions(tokenizer, args)
    plan = make_plan(tokenizer, sessions, args, model_dir)
    print(header(args, plan), flush=True)
    if args.concurrency * math.ceil(plan.max_session_tokens / BLOCK_SIZE) > plan.pool_blocks:
        print("note: the concurrent sessions' longest chats outgrow the pool; requests may "
              "wait for decode KV room", flush=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-disk-") as disk_dir:
        results = {name: run_config(name, tiers, args, model_dir, plan, sessions, tokenizer)
                   for name, tiers in plan.configs(args.disk, disk_dir).items()}
    report(args, plan, results, started)


if __name__ == "__main__":
    main()
