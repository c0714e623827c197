"""A chat reply's reasoning split from its answer, as vLLM's `--reasoning-parser`. Pure: no I/O.

Reasoning models write their chain of thought between `<think>` and `</think>`, then the
answer. With a parser set, a chat reply's reasoning goes out as `reasoning_content` and only
the answer as `content` (the tags in neither), and tool calls are read from the answer alone.

The two `<think>` parsers differ only in what a reply that does not open with `<think>` is:
- `deepseek_r1`: reasoning up to `</think>`. R1's chat template already ends the prompt with
  `<think>`, so the reply may start inside it; one that never closes it is all reasoning.
- `qwen3`: content. Qwen3 opens `<think>` itself when it thinks.
A `<think>` opening the reply (after blanks) is dropped, the reasoning runs to the first
`</think>` (to the end when none comes: a reply cut by max_tokens), the rest is the answer.
A `<think>` anywhere else is text.

`openai_gptoss` reads gpt-oss's harmony replies instead (router.harmony, a scanner with the
same contract): reasoning from its analysis channel, the answer from its final channel.

Per request, the chat template's `enable_thinking: false` (Qwen3's switch, passed in
`chat_template_kwargs`) turns the split off: the reply is all content (refused for gpt-oss,
which always reasons). A reply constrained by a grammar (structured outputs, a forced tool
choice) is shaped from its first token, so it holds reasoning only where it opens with
`<think>` (or a harmony marker) itself (vLLM applies the grammar after the reasoning; here the
grammar covers the whole reply).

One scanner, `scan(text, mode, final) -> (reasoning, content, consumed, mode)`, as in
router/tools.py: it decides as far as it can and says what it consumed. A whole reply is one
final scan (`split`); a stream (`ReasoningStream`) scans what it holds after each delta and
keeps back only a possible tag's beginning, so a stream cut anywhere (`</thi` | `nk>`)
reassembles to the whole parse. Modes: START_REASONING / START_CONTENT (nothing decided yet;
what an untagged reply is), REASONING (inside the block), CONTENT (the rest is the answer);
harmony modes are router.harmony's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.router import harmony

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
START_REASONING, START_CONTENT = "start:reasoning", "start:content"
REASONING, CONTENT = "reasoning", "content"
# parser -> the first mode of a free (unconstrained) reply
REASONING_PARSERS: Mapping[str, str] = {"deepseek_r1": START_REASONING, "qwen3": START_CONTENT,
                                        "openai_gptoss": harmony.FIRST_MODE}


def check_parser(parser: str | None) -> None:
    """ValueError naming the setting unless `parser` is one of REASONING_PARSERS (or None)."""
    if parser is not None and parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} "
                         f"(or unset: no reasoning split), got {parser!r}")


def enable_thinking(template_kwargs: Mapping[str, Any]) -> bool:
    """The request's `chat_template_kwargs.enable_thinking` (default true); ValueError
    naming it when it is not a boolean (a template would read "false" as true)."""
    value = template_kwargs.get("enable_thinking", True)
    if not isinstance(value, bool):
        raise ValueError(f"chat_template_kwargs.enable_thinking must be a boolean, got "
                         f"{value!r}")
    return value


def first_mode(parser: str | None, thinking: bool = True,
               constrained: bool = False, calls: bool = False) -> str | None:
    """The scanner's first mode for one chat reply; None: no split (no parser, or thinking
    turned off by the request). `calls`: the reply's calls to functions are read (harmony's
    with `--tool-call-parser openai`). ValueError for thinking turned off where it means
    nothing: gpt-oss always reasons (its template reads `reasoning_effort` instead)."""
    check_parser(parser)
    if parser is None:
        return None
    first = REASONING_PARSERS[parser]
    if harmony.is_harmony(first):
        if not thinking:
            raise ValueError('chat_template_kwargs.enable_thinking: false does not turn off '
                             'gpt-oss\'s reasoning (openai_gptoss always reasons): set '
                             'reasoning_effort "low" to shorten it, or include_reasoning false '
                             'to leave it out of the answer')
        # a reply a grammar shapes holds no marker: all content anyway
        return harmony.FIRST_MODE_CALLS if calls else first
    if not thinking:
        return None
    return START_CONTENT if constrained else first


def keeps_special_tokens(mode: str | None) -> bool:
    """Whether a reply read from `mode` is detokenized with its special tokens kept: harmony's
    markers are special tokens, and the scanner drops them all."""
    return harmony.is_harmony(mode)


def _partial_tag(text: str, tag: str) -> int:
    """How many of text's last characters could begin `tag` (held until known)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def scan(text: str, mode: str, final: bool) -> tuple[str, str, int, str]:
    """The reasoning and the content `text` decides (the reasoning always first), how much of
    `text` that consumed, and the mode to go on in. `final`: no more text comes."""
    if harmony.is_harmony(mode):
        return harmony.scan(text, mode, final)
    pos = 0
    if mode in (START_REASONING, START_CONTENT):
        head = text.lstrip()
        if head.startswith(THINK_OPEN):
            pos, mode = len(text) - len(head) + len(THINK_OPEN), REASONING
        elif not final and THINK_OPEN.startswith(head):  # blank so far, or the tag's beginning
            return "", "", 0, mode
        else:
            mode = REASONING if mode == START_REASONING else CONTENT
    reasoning = ""
    if mode == REASONING:
        end = text.find(THINK_CLOSE, pos)
        if end == -1:
            stop = len(text) if final else len(text) - _partial_tag(text[pos:], THINK_CLOSE)
            return text[pos:stop], "", stop, mode
        reasoning, pos, mode = text[pos:end], end + len(THINK_CLOSE), CONTENT
    return reasoning, text[pos:], len(text), mode


def split(text: str, mode: str) -> tuple[str | None, str]:
    """A whole reply's reasoning (None when it has none, or only an empty block) and content."""
    reasoning, content, _, _ = scan(text, mode, True)
    return reasoning or None, content


class ReasoningStream:
    """`split` for a streamed reply: `feed` each text delta, then `finish`; each returns the
    (reasoning, content) text it decided."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._held = ""  # the text not decided yet: a possible tag's beginning

    def feed(self, delta: str) -> tuple[str, str]:
        self._held += delta
        return self._scan(final=False)

    def finish(self) -> tuple[str, str]:
        return self._scan(final=True)

    @property
    def answering(self) -> bool:
        """Everything from here on is content (the reasoning is over, or there is none)."""
        return self.mode == CONTENT and not self._held

    def _scan(self, final: bool) -> tuple[str, str]:
        reasoning, content, consumed, self.mode = scan(self._held, self.mode, final)
        self._held = self._held[consumed:]
        return reasoning, content
