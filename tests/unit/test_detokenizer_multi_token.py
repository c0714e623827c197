"""IncrementalDetokenizer fed several tokens per update (speculative decoding, coalesced steps):
text, stop string and the number of tokens kept equal one-token-at-a-time feeding."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pdserve.engine.detokenizer import IncrementalDetokenizer

CHAT_PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
TEXTS = [
    "The cat sat on the mat and then it slept for a while.",
    "Emoji: 😀🎉 and a family 👨‍👩‍👧 in a row, then more words.",
    "中文测试：你好，世界。日本語もね。",
    "Mixed: naïve café, ünïcode, Ελληνικά, 한국어 🙂\n\n  indented line",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(smollm2_dir)


def feed(tokenizer, prompt: Sequence[int], out: Sequence[int], stop: Sequence[str],
         sizes: Sequence[int]) -> tuple[str, int, str | None]:
    """(text, tokens kept, stop string) after feeding `out` in chunks of `sizes` (cycled)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    text, kept, start, step = "", 0, 0, 0
    while start < len(out) and not detok.finished:
        chunk = out[start : start + sizes[step % len(sizes)]]
        update = detok.update(chunk)
        text += update.delta
        kept += update.num_tokens
        if update.stop_string is None:
            assert update.num_tokens == len(chunk)  # no stop string: every token is kept
        else:
            assert 1 <= update.num_tokens <= len(chunk)
        start, step = start + len(chunk), step + 1
    return text + detok.flush(), kept, detok.stop_string


def random_sizes(rng: random.Random) -> list[int]:
    return [rng.randint(1, 7) for _ in range(rng.randint(1, 6))]


def random_stops(rng: random.Random, text: str) -> list[str]:
    """A stop string cut from `text` (so one is hit, somewhere along it), often with a piece
    of it that completes first although it starts later, and one that never appears."""
    start = rng.randrange(len(text) - 3)
    cut = text[start : start + rng.randint(3, 8)]
    inner = 1 + rng.randrange(len(cut) - 1)
    return ["never appears", cut, cut[inner : inner + rng.randint(1, 2)] if rng.random() < 0.5
            else text[rng.randrange(len(text) - 1) :][:4]]


@pytest.mark.parametrize("seed", range(12))
def test_chunked_feeding_equals_one_token_at_a_time(smollm2, seed: int) -> None:
    rng = random.Random(seed)
    text = TEXTS[seed % len(TEXTS)]
    out = smollm2.encode(text)
    stop = random_stops(rng, text)
    prompt = smollm2.encode(CHAT_PROMPT)
    one_by_one = feed(smollm2, prompt, out, stop, [1])
    assert one_by_one[2] is not None
    assert one_by_one[0] == text[: len(one_by_one[0])]
    for _ in range(6):
        sizes = random_sizes(rng)
        assert feed(smollm2, prompt, out, stop, sizes) == one_by_one, sizes
    assert feed(smollm2, prompt, out, stop, [len(out)]) == one_by_one


@pytest.mark.parametrize("seed", range(6))
def test_random_token_ids_chunked_equal_one_token_at_a_time(smollm2, seed: int) -> None:
    """Arbitrary ids (half characters, special tokens); stop strings from their decode."""
    rng = random.Random(100 + seed)
    byte_ids = [i for i in range(2000) if "\ufffd" in smollm2.decode([i])]
    out = [rng.choice(byte_ids) if rng.random() < 0.3 else rng.randrange(len(smollm2))
           for _ in range(40)]
    full = smollm2.decode(out, skip_special_tokens=True).replace("\ufffd", "")
    stop = random_stops(rng, full)
    one_by_one = feed(smollm2, [], out, stop, [1])
    for _ in range(6):
        sizes = random_sizes(rng)
        assert feed(smollm2, [], out, stop, sizes) == one_by_one, sizes


def test_the_update_keeps_tokens_through_the_one_completing_the_stop_string(smollm2) -> None:
    out = smollm2.encode("The cat sat on the mat and then it slept.")
    on = next(i for i in range(len(out)) if smollm2.decode(out[: i + 1]).endswith("sat on"))
    assert on < len(out) - 2  # tokens follow the one completing it, in the same update
    detok = IncrementalDetokenizer(smollm2, [], ["sat on"])
    update = detok.update(out)
    assert (update.delta, update.stop_string, update.num_tokens) == ("The cat ", "sat on", on + 1)


def test_overlapping_stop_strings_first_completed_wins(smollm2) -> None:
    """"bc" completes (at "c") before "abcd" does, although "abcd" starts earlier: one token
    at a time "bc" is hit, so several tokens at a time it must be too."""
    out = [smollm2.convert_tokens_to_ids(c) for c in "xabcdy"]
    assert smollm2.decode(out) == "xabcdy"
    one_by_one = feed(smollm2, [], out, ["abcd", "bc"], [1])
    assert one_by_one == ("xa", 4, "bc")
    assert feed(smollm2, [], out, ["abcd", "bc"], [len(out)]) == one_by_one


def test_without_stop_strings_every_token_is_kept(smollm2) -> None:
    out = smollm2.encode(TEXTS[1])
    detok = IncrementalDetokenizer(smollm2, [])
    assert detok.update(out[:5]).num_tokens == 5
    assert detok.update(out[5:6]).num_tokens == 1
    assert detok.update([]).num_tokens == 0
    rest = detok.update(out[6:])
    assert (rest.num_tokens, rest.stop_string) == (len(out) - 6, None)
