"""Structured outputs: grammar-constrained decoding with xgrammar (vLLM's `structured_outputs`).

A request names one kind of constraint (`StructuredOutputsParams`, in its own torch-free
module so SamplingParams can carry it to the router; re-exported here); the router checks it
without a tokenizer (`check_structured_outputs`), so a bad one is a 400 before any worker sees
it. On the engine, one `GrammarCompiler` turns it into an xgrammar CompiledGrammar on a
background thread (cached, so a repeated schema costs nothing); each request's `GrammarState`
follows the tokens it accepts and fills its row of a token bitmask, which the kernel backend's
`apply_token_bitmask` turns into -inf logits before sampling.

JSON is generated compact and strict: no free whitespace (json.dumps' default separators
", " and ": ") and no properties the schema does not name, so a small model cannot loop on
whitespace or wander into keys nobody asked for.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import time
from collections.abc import Sequence

import jsonschema
import torch
import xgrammar as xgr

from pdserve.engine.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_JSON_FORMAT = {"any_whitespace": False, "strict_mode": True}
_ANY_OBJECT = '{"type": "object"}'  # json_object: any object (xgrammar's builtin allows arrays)
_MAX_ERROR_CHARS = 200
# xgrammar's errors open with "[hh:mm:ss] /project/cpp/file.cc:123: " and often a failed
# check's condition; the reader needs what follows (or, if nothing does, the condition).
_XGRAMMAR_WHERE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_XGRAMMAR_CHECK = re.compile(r"^Check failed: .*? is false: (?=\S)", re.DOTALL)


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Refuse what could not compile, without a tokenizer: the router answers 400 with this.

    Raises ValueError "structured_outputs.<kind>: <what is wrong>" (one bounded line).
    """
    kind = params.kind
    if params.json is not None:
        try:
            schema = json.loads(params.json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json: a JSON Schema is an object or a boolean, "
                             f"got {type(schema).__name__}")
        validator = jsonschema.validators.validator_for(
            schema, default=jsonschema.Draft202012Validator)
        try:
            validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "the schema"
            raise ValueError(f"structured_outputs.json: not a valid JSON Schema at {where}: "
                             f"{_short(exc.message)}") from None
    try:
        _grammar(params)
    except (RuntimeError, ValueError) as exc:
        raise _refusal(kind, exc) from None


class GrammarCompiler:
    """One per engine: the tokenizer's xgrammar vocabulary and a bounded cache of compiled
    grammars, compiled on a background thread (off the engine's step path).

    `vocab_size` is the model's (the logits' width), which may exceed len(tokenizer): the ids
    past the tokenizer's are never allowed. xgrammar releases the GIL while it compiles.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 max_cache_bytes: int = 256 << 20) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True,
                                             cache_limit_bytes=max_cache_bytes)
        # xgrammar 0.2.8's cache fails some grammars it compiles fine without it (a JSON
        # `pattern` with a long repetition such as [a-z]{0,200}: "per_rule_fsm_hashes").
        self._uncached = xgr.GrammarCompiler(info, cache_enabled=False)
        # One thread: compiles queue behind each other, and a repeat finds its twin cached.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="grammar-compiler")

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """Future[xgr.CompiledGrammar]; a grammar that fails raises ValueError from it."""
        return self._executor.submit(self._compile, params)

    @property
    def cache_bytes(self) -> int:
        """What the compiled-grammar cache holds now (at most about max_cache_bytes)."""
        return self._compiler.get_cache_size_bytes()

    def close(self) -> None:
        """Stop the thread; compiles not yet started are cancelled."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        try:
            compiled = _compile_with(self._compiler, params)
        except RuntimeError:
            try:
                compiled = _compile_with(self._uncached, params)
            except RuntimeError as exc:
                raise _refusal(params.kind, exc) from None
        # String length bounds cost most: maxLength 200 takes ~2 s (a cache hit ~0.1 ms).
        logger.debug("%s grammar ready in %.1f ms", params.kind,
                     (time.perf_counter() - start) * 1e3)
        return compiled


class GrammarState:
    """One request's position in its grammar (an xgr.GrammarMatcher), advanced by accepted
    tokens only.

    `replay` holds tokens the request generated before this state existed (on another worker,
    or before a preemption); they are accepted once the grammar is ready. After the grammar
    terminates (its stop token accepted) it constrains nothing: later tokens are ignored and
    the mask allows every token, as in vLLM (a request with ignore_eos runs on unconstrained).
    """

    def __init__(self, compiled: concurrent.futures.Future, replay: Sequence[int] = ()) -> None:
        self._compiled = compiled
        self._replay = tuple(replay)
        self._matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """The compile finished (successfully or not): the next call will not wait on it."""
        return self._compiled.done()

    @property
    def error(self) -> str | None:
        """Why the grammar did not compile ("structured_outputs.<kind>: ..."), else None
        (blocks until ready): the request ends with it."""
        if self._compiled.cancelled():
            return "structured_outputs: the engine's grammar compiler was closed"
        exc = self._compiled.exception()
        return None if exc is None else str(exc)

    @property
    def terminated(self) -> bool:
        """The grammar accepted its stop token; False while it still compiles."""
        return self.ready and self._match().is_terminated()

    def accept(self, token_ids: Sequence[int]) -> None:
        """Advance by each token (blocks until ready); a token the grammar rejects raises
        ValueError, which sampling under the mask never produces."""
        _accept_all(self._match(), token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row] = the tokens allowed now (blocks until ready). bitmask is on CPU."""
        matcher = self._match()
        if matcher.is_terminated():
            bitmask[row] = -1
        else:
            matcher.fill_next_token_bitmask(bitmask, row)

    def fill_draft_bitmasks(self, bitmask: torch.Tensor, first_row: int,
                            drafts: Sequence[int]) -> None:
        """Speculative decoding: row first_row + j (j = 0..len(drafts)) gets the mask at the
        state after drafts[:j]; the state is unchanged afterwards.

        Once a draft is rejected, the rows after it repeat the rejecting row's mask: the
        sampler rejects that draft anyway, since its own row's mask excludes it.
        """
        matcher = self._match()
        accepted = 0
        for j, token in enumerate(drafts):
            self.fill_bitmask(bitmask, first_row + j)
            if matcher.is_terminated():
                continue  # drafts past the stop token: unconstrained, as in fill_bitmask
            if not matcher.accept_token(int(token)):
                bitmask[first_row + j + 1:first_row + len(drafts) + 1] = bitmask[first_row + j]
                break
            accepted += 1
        else:
            self.fill_bitmask(bitmask, first_row + len(drafts))
        if accepted:
            matcher.rollback(accepted)

    def _match(self) -> xgr.GrammarMatcher:
        """The matcher, built on first use: waits for the compile, then replays."""
        if self._matcher is None:
            matcher = xgr.GrammarMatcher(self._compiled.result())
            _accept_all(matcher, self._replay)
            self._matcher, self._replay = matcher, ()
        return self._matcher


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """All-allowed (every bit set) token bitmask: int32 [num_rows, ceil(vocab_size / 32)], on
    the CPU, where xgrammar's matcher writes (the kernel takes it to the logits' device)."""
    return torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def _compile_with(compiler: xgr.GrammarCompiler,
                  params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    if params.json is not None or params.json_object:
        return compiler.compile_json_schema(params.json or _ANY_OBJECT, **_JSON_FORMAT)
    if params.regex is not None:
        return compiler.compile_regex(params.regex)
    return compiler.compile_grammar(_ebnf(params))


def _grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar `GrammarCompiler` would compile, built without a tokenizer."""
    if params.json is not None or params.json_object:
        return xgr.Grammar.from_json_schema(params.json or _ANY_OBJECT, **_JSON_FORMAT)
    if params.regex is not None:
        return xgr.Grammar.from_regex(params.regex)
    return xgr.Grammar.from_ebnf(_ebnf(params))


def _ebnf(params: StructuredOutputsParams) -> str:
    """The grammar's EBNF, or for `choice` one alternative per string (JSON string escapes
    are EBNF's: quotes, backslashes and control characters survive)."""
    if params.choice is not None:
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
    return params.grammar


def _accept_all(matcher: xgr.GrammarMatcher, token_ids: Sequence[int]) -> None:
    for token_id in token_ids:
        if matcher.is_terminated():
            return
        if not matcher.accept_token(int(token_id)):
            raise ValueError(f"structured_outputs: token {token_id} is not allowed by the "
                             "grammar here")


def _refusal(kind: str, exc: Exception) -> ValueError:
    text = _XGRAMMAR_CHECK.sub("", _XGRAMMAR_WHERE.sub("", str(exc).strip()))
    return ValueError(f"structured_outputs.{kind}: {_short(text) or 'xgrammar cannot use it'}")


def _short(text: str) -> str:
    """One line of at most _MAX_ERROR_CHARS: error messages go back to clients."""
    line = " ".join(text.split())
    return line if len(line) <= _MAX_ERROR_CHARS else line[:_MAX_ERROR_CHARS - 3] + "..."
