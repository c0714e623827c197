"""gpt-oss's harmony reply read into reasoning and answer (`--reasoning-parser openai_gptoss`).
Pure: no I/O.

After the prompt's `<|start|>assistant`, gpt-oss writes messages, each a header, `<|message|>`,
its text and an end:
    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>
    ANSWER<|return|>
The header names the channel and, for a tool call, the recipient
(`<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>`). As vLLM's
gpt-oss parser reads them: `analysis` messages are the reasoning, `final` messages and
`commentary` without a recipient (preambles) the answer, each kind's messages joined by "\\n";
a message to a recipient (a tool call) is neither; a reply cut inside a message keeps what
that message wrote (a reply cut before `final` is all reasoning). The markers are special
tokens: the router detokenizes these replies with special tokens kept (router.stream) and this
scanner drops every one, so neither part ever holds a marker. A reply that opens with anything
but a marker or a recipient (" to=", the header's rest: blanks aside) is content until a
marker comes: one with none is all content.

With `--tool-call-parser openai` and a request whose tools the model may call (tool_choice
"auto"), a message to `functions.NAME` is a call instead: it goes into the content framed as
`<|start|>functions.NAME<|message|>ARGUMENTS<|call|>` (the markers cannot come from the reply
there: the scanner drops every one), which router.tools' `openai` parser reads back as the call.

`scan` has router.reasoning's contract (it decides as far as it can, says what it consumed
and the mode to go on in), so `split` and `ReasoningStream` read harmony replies unchanged; a
header is held whole until its `<|message|>`, a marker's beginning until it is known. Its modes
are "<kind>:<state>:<kinds>": the kind "harmony", or "harmony+calls" when calls are read; the
state START, HEADER or the body's destination (REASONING, CONTENT, CALL, NEITHER); kinds ("r",
"c") the parts that had a message already (the next one is joined with "\\n").
"""

from __future__ import annotations

import re

HARMONY, HARMONY_CALLS = "harmony", "harmony+calls"
START, HEADER = "start", "header"
REASONING, CONTENT, CALL, NEITHER = "reasoning", "content", "call", "neither"
FIRST_MODE, FIRST_MODE_CALLS = f"{HARMONY}:{START}:", f"{HARMONY_CALLS}:{START}:"
CALL_OPEN, CALL_CLOSE = "<|start|>", "<|call|>"  # a call's frame in the content

MESSAGE = "<|message|>"
# gpt-oss's special tokens a reply may hold (its o200k_harmony vocabulary's named ones)
MARKER = re.compile(r"<\|(?:start|end|message|channel|constrain|return|call|startoftext"
                    r"|endoftext|endofprompt|reserved_\d+)\|>")
_OPENS = ("<|start|>", "<|channel|>")  # a header begins at them (they are part of it)
_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|endoftext|>")  # a header begins after them
_MAYBE_MARKER = re.compile(r"<(?:\|[a-z_0-9]*\|?)?")  # a marker's beginning: held back
_LONGEST_MARKER = len("<|reserved_201087|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=")
_FUNCTION = re.compile(r"\bto=functions\.([^\s<]+)")
# the prompt ends with "<|start|>assistant", so a header that names its recipient before its
# channel ("<|start|>assistant to=functions.f<|channel|>commentary json<|message|>", as
# gpt-oss's chat template writes tool calls) begins the reply with this
RECIPIENT_FIRST = "to="


def is_harmony(mode: str | None) -> bool:
    return mode is not None and mode.split(":", 1)[0] in (HARMONY, HARMONY_CALLS)


def _held_marker(text: str) -> int:
    """How many of text's last characters could begin a marker (held until known)."""
    at = text.rfind("<", max(0, len(text) - _LONGEST_MARKER))
    return len(text) - at if at != -1 and _MAYBE_MARKER.fullmatch(text, at) else 0


def destination(header: str, calls: bool = False) -> str:
    """Where a message's text goes, from its header (the text before `<|message|>`); `calls`:
    a message to a function is a call."""
    channels = _CHANNEL.findall(header)
    channel = channels[-1] if channels else None
    if channel == "analysis":
        return REASONING
    if channel == "final" or (channel == "commentary" and not _RECIPIENT.search(header)):
        return CONTENT
    if calls and _FUNCTION.search(header):
        return CALL
    return NEITHER  # a call not read, another recipient, an unknown channel, or none


class _Parts:
    """The reasoning and content one scan decides, and which parts had a message."""

    def __init__(self, kind: str, kinds: str) -> None:
        self.kind, self.kinds = kind, kinds
        self.text = {REASONING: [], CONTENT: [], NEITHER: []}
        self.text[CALL] = self.text[CONTENT]  # a call's frame goes into the content

    def open(self, dest: str, header: str = "") -> None:
        """A new message's text goes to `dest`: after another of its kind, a "\\n" first; a
        call's text after its frame's opening."""
        if dest == CALL:
            name = _FUNCTION.search(header)[1]
            self.text[CALL].append(f"{CALL_OPEN}functions.{name}{MESSAGE}")
            return
        if dest == NEITHER:
            return
        kind = dest[0]
        if kind in self.kinds:
            self.text[dest].append("\n")
        else:
            self.kinds += kind

    def close(self, state: str) -> None:
        """The message in `state` ended: a call's frame closes."""
        if state == CALL:
            self.text[CALL].append(CALL_CLOSE)

    def result(self, consumed: int, state: str) -> tuple[str, str, int, str]:
        return ("".join(self.text[REASONING]), "".join(self.text[CONTENT]), consumed,
                f"{self.kind}:{state}:{self.kinds}")


def scan(text: str, mode: str, final: bool) -> tuple[str, str, int, str]:
    """The reasoning and the content `text` decides, how much of `text` that consumed, and
    the mode to go on in (router.reasoning.scan's contract). `final`: no more text comes."""
    kind, state, kinds = mode.split(":")
    parts, pos = _Parts(kind, kinds), 0
    if state == START:
        start = len(text) - len(text.lstrip())
        if not final and (start == len(text) or _MAYBE_MARKER.fullmatch(text, start)
                          or RECIPIENT_FIRST.startswith(text[start:])):
            # blank so far, or a marker's beginning ("<|cha"), or "to" of "to="
            return parts.result(0, START)
        if MARKER.match(text, start):
            state, pos = NEITHER, start  # the marker decides (blanks before it go)
        elif text.startswith(RECIPIENT_FIRST, start):
            state, pos = HEADER, start  # the header goes on: a recipient before the channel
        else:
            state = CONTENT
            parts.open(CONTENT)
    while True:
        if state == HEADER:
            at = text.find(MESSAGE, pos)
            body = at + len(MESSAGE)
            if at == -1 or body == len(text):  # held whole; dropped when the reply ends
                return parts.result(len(text) if final else pos, HEADER)
            header = text[pos:at]
            state, pos = destination(header, kind == HARMONY_CALLS), body
            parts.open(state, header)
            continue
        marker = MARKER.search(text, pos)
        if marker is None:
            end = len(text) if final else len(text) - _held_marker(text[pos:])
            parts.text[state].append(text[pos:end])
            if final:
                parts.close(state)
            return parts.result(end, state)
        parts.text[state].append(text[pos:marker.start()])
        if marker.group() in _OPENS:
            parts.close(state)
            state, pos = HEADER, marker.start()
        elif marker.group() in _ENDS:
            parts.close(state)
            state, pos = HEADER, marker.end()
        else:  # <|message|> or <|constrain|> outside a header, a stray token: dropped
            pos = marker.end()
