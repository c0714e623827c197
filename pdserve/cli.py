"""The `pdserve` command line: generate | chat (offline, in this process, for now)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from engine.default_model import DEFAULT_MODEL
from engine.sampling_params import SamplingParams


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="HF directory or known name")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=0.5, help="KV cache budget")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("-v", "--verbose", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream an answer to one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template: plain completion")
    _engine_args(gen)
    chat = sub.add_parser("chat", help="multi-turn conversation on stdin/stdout")
    _engine_args(chat)
    return parser


def _make_llm(args: argparse.Namespace):
    from pdserve.llm import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
        num_threads=args.threads,
    )


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        seed=args.seed,
    )


def _stream(llm, prompt, params: SamplingParams) -> str:
    """Run one request, writing text deltas to stdout as they come."""
    engine = llm.engine
    engine.add_request("cli", prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            text = out.text
    sys.stdout.write("\n")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        params = _params(args)
        llm = _make_llm(args)
        if args.command == "generate":
            prompt = args.prompt
            if not args.raw:
                from engine.input_processor import chat_prompt

                prompt = chat_prompt([{"role": "user", "content": prompt}], llm.tokenizer)
            _stream(llm, prompt, params)
            return 0
        return _chat(llm, params)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


def _chat(llm, params: SamplingParams) -> int:
    from engine.input_processor import chat_prompt

    messages: list[dict[str, str]] = []
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = _stream(llm, chat_prompt(messages, llm.tokenizer), params)
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    raise SystemExit(main())
