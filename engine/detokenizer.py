"""IncrementalDetokenizer: streams one request's text as its tokens arrive, cut at stop strings.

Offset-window decoding (as vLLM and TGI do): each step decodes only the tokens since the last
release plus the tokens released just before them, which serve as context (a sentencepiece
decoder drops the leading space of the first token it sees, so the context token takes that
place). The text the new tokens add is the window's text minus the context's text. While the
window ends in U+FFFD (half a UTF-8 character) nothing is released; the last
(longest stop string - 1) characters are held back so a stop string spanning tokens is caught.
No torch here: the router detokenizes. With a transformers fast tokenizer the windows go straight
to its Rust `tokenizers.Tokenizer` (`native_decode`): the same text as `tokenizer.decode`, at a
fifth of the cost, which matters at one call per streamed message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import tokenizers

logger = logging.getLogger(__name__)

# Prompt tokens kept as decoding context for the first output tokens (vLLM uses 5 too).
NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """What we need of a tokenizer: HF `PreTrainedTokenizerBase` and `tokenizers.Tokenizer` fit."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def native_decode(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)` equal to `tokenizer.decode`, in native code when it can.

    A transformers fast tokenizer's `decode` is its Rust backend's plus Python argument
    handling, and a clean-up pass only when `clean_up_tokenization_spaces` is set (ignored
    for BPE models unless forced): then the backend alone gives the same text. Anything else
    (a slow tokenizer, the clean-up on) keeps the tokenizer's own `decode`.
    """
    backend = tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else None
    wrapped = getattr(tokenizer, "_tokenizer", None)
    if isinstance(wrapped, tokenizers.Tokenizer) and not _cleans_up(tokenizer):
        backend = wrapped
    if backend is None:
        return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)


def _cleans_up(tokenizer: Any) -> bool:
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(tokenizer,
                     "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                     False)
    return forced or type(tokenizer.backend_tokenizer.model).__name__ != "BPE"


@dataclass(frozen=True)
class DetokenizerUpdate:
    delta: str  # text released by this update
    # How many of the update's tokens the output keeps: all of them, or with a stop string
    # those through the one that completed it (tokens after it are dropped, as the text is).
    num_tokens: int
    stop_string: str | None = None  # the stop string hit; the request must finish


class IncrementalDetokenizer:
    """Streams text deltas for one request.

    Deltas + `flush()` equal the text the output tokens add after the prompt, i.e.
    `decode(prompt + output)[len(decode(prompt)):]`. For byte-level BPE that is
    `decode(output)`; for sentencepiece tokenizers it keeps the first token's leading space,
    which `decode(output)` alone strips. One known gap: HF's ByteFallback decoder turns a
    whole run of <0xNN> tokens into U+FFFDs when any byte in it is invalid, retroactively;
    a stream cannot unsay characters already sent, so for invalid byte runs (garbage output)
    the streamed text can differ from decode() in where its U+FFFDs are.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        self._decode_fn = native_decode(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._stop = stop
        self._num_held_chars = max((len(s) for s in stop), default=1) - 1
        # The window: token_ids[:read_offset] is context already decoded, the rest is pending.
        self._prefix_text: str | None  # decode of the context, cached
        self._token_ids, self._prefix_text = self._initial_context(prompt_token_ids)
        self._read_offset = len(self._token_ids)
        self._decoded = ""  # output text decoded so far; released up to _num_released
        self._num_released = 0
        self._stop_string: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._decoded[: self._num_released]

    @property
    def stop_string(self) -> str | None:
        return self._stop_string

    @property
    def finished(self) -> bool:
        """True after a stop string was hit or after `flush()`."""
        return self._finished

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Adds the step's new tokens; returns the text now safe to release.

        Several tokens at once (speculative decoding, coalesced steps) with stop strings are
        fed one at a time: the update then ends at the token that completed a stop string,
        with the text and stop string one token per update would give (the first stop string
        completed, not the earliest starting one in the whole update's text).
        """
        assert not self._finished, "update() after a stop string or flush()"
        if not self._stop or len(new_token_ids) <= 1:
            return self._add(new_token_ids)
        deltas: list[str] = []
        for i, token_id in enumerate(new_token_ids):
            update = self._add((token_id,))
            deltas.append(update.delta)
            if update.stop_string is not None:
                return DetokenizerUpdate("".join(deltas), i + 1, update.stop_string)
        return DetokenizerUpdate("".join(deltas), len(new_token_ids))

    def flush(self) -> str:
        """Releases everything held back (half characters as U+FFFD); ends the stream.

        Call when the request finishes for another reason than a stop string (EOS, stop token,
        max_tokens). After a stop string it returns "": text past a stop string is dropped.
        """
        if self._finished:
            return ""
        self._decode_window(final=True)
        delta, _ = self._release(final=True)
        self._finished = True
        return delta

    def _add(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        self._token_ids.extend(new_token_ids)
        self._decode_window(final=False)
        delta, stop_string = self._release(final=False)
        return DetokenizerUpdate(delta, len(new_token_ids), stop_string)

    def _initial_context(self, prompt_token_ids: Sequence[int]) -> tuple[list[int], str]:
        prompt = list(prompt_token_ids)
        first = max(0, len(prompt) - NUM_CONTEXT_TOKENS)
        # A window cut inside a character decodes to U+FFFD; with sentencepiece byte fallback
        # the whole byte run does, up to its end. A character is at most 4 byte tokens long.
        for start in range(first, max(-1, first - 4), -1):
            text = self._decode(prompt[start:])
            if not text.endswith(_REPLACEMENT_CHAR):
                return prompt[start:], text
        # The prompt (given as token ids) ends inside a character: its completion would
        # misalign the window's text against the context's, so that tail is no context.
        context = prompt[first:]
        while context and text.endswith(_REPLACEMENT_CHAR):
            context.pop()
            text = self._decode(context)
        return context, text

    def _decode_window(self, final: bool) -> None:
        if self._read_offset == len(self._token_ids):
            return
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._token_ids[: self._read_offset])
        window_text = self._decode(self._token_ids)
        if not final and (
            len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR)
        ):
            return  # nothing yet (a skipped special token) or half a character: wait
        self._decoded += window_text[len(self._prefix_text) :]
        # The tokens just decoded become the next window's context; older ones are dropped.
        del self._token_ids[: self._read_offset]
        self._read_offset = len(self._token_ids)
        self._prefix_text = None

    def _release(self, final: bool) -> tuple[str, str | None]:
        """The text now safe to release, and the stop string it was cut at."""
        start = self._num_released
        stop_at, stop_string = self._find_stop(start)
        if stop_string is not None:
            end = stop_at
            self._stop_string = stop_string
            self._finished = True
        elif final:
            end = len(self._decoded)
        else:
            end = max(start, len(self._decoded) - self._num_held_chars)
        self._num_released = end
        return self._decoded[start:end], stop_string

    def _find_stop(self, start: int) -> tuple[int, str | None]:
        """Earliest stop string starting at or after `start` (shortest on a tie).

        Text before `start` was released only once (longest stop - 1) characters followed
        it, so a match not seen by an earlier call cannot begin there.
        """
        best_at, best = len(self._decoded) + 1, None
        for s in self._stop:
            at = self._decoded.find(s, start)
            if at != -1 and (at < best_at or (at == best_at and len(s) < len(best))):
                best_at, best = at, s
        return best_at, best

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_fn(token_ids, self._skip_special_tokens)
