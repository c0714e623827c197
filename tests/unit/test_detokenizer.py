"""IncrementalDetokenizer against real tokenizers: byte-level BPE (SmolLM2) and sentencepiece-style
(a tiny BPE with byte fallback, trained here offline)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pdserve.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer, native_decode

FFFD = "\ufffd"
CHAT_PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
TEXTS = [
    "Hello there! How can I help you today?",
    "Emoji: 😀🎉 and a family 👨‍👩‍👧 in a row.",
    "中文测试：你好，世界。日本語もね。",
    "Mixed: naïve café, ünïcode, Ελληνικά, 한국어 🙂\n\n  indented line",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(smollm2_dir)


def stream(
    tokenizer,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    stop: Sequence[str] = (),
    skip_special_tokens: bool = True,
    chunk_sizes: Sequence[int] = (1,),
) -> tuple[IncrementalDetokenizer, list[DetokenizerUpdate]]:
    """Feeds `output_ids` in chunks (sizes cycle) until done or a stop string is hit."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop, skip_special_tokens)
    updates, start, step = [], 0, 0
    while start < len(output_ids) and not detok.finished:
        size = chunk_sizes[step % len(chunk_sizes)]
        updates.append(detok.update(output_ids[start : start + size]))
        start, step = start + size, step + 1
    return detok, updates


def joined(updates: Sequence[DetokenizerUpdate]) -> str:
    return "".join(u.delta for u in updates)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_and_is_released_promptly(smollm2, text: str) -> None:
    prompt = smollm2.encode(CHAT_PROMPT)
    out = smollm2.encode(text)
    if not text.isascii():  # the case under test: characters split across tokens
        assert any(FFFD in smollm2.decode([t]) for t in out)
    detok, released = IncrementalDetokenizer(smollm2, prompt), ""
    for i, token in enumerate(out):
        update = detok.update([token])
        assert FFFD not in update.delta
        # All text is out as soon as it ends in a whole character (not half an emoji).
        so_far = smollm2.decode(out[: i + 1])
        released = released if so_far.endswith(FFFD) else so_far
        assert detok.text == released
    assert detok.flush() == ""
    assert detok.text == smollm2.decode(out) == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_random_token_ids_stream_to_the_full_decode(
    smollm2, seed: int, skip_special_tokens: bool
) -> None:
    rng = random.Random(seed)
    # Byte tokens (ids of lone bytes such as 'ðŁĺ' pieces), special tokens and anything else.
    byte_ids = [i for i in range(smollm2.vocab_size) if FFFD in smollm2.decode([i])]
    pool = [
        lambda: rng.randrange(len(smollm2)),
        lambda: rng.choice(byte_ids),
        lambda: rng.randrange(17),
    ]
    out = [rng.choice(pool)() for _ in range(300)]
    prompt = [rng.choice(pool)() for _ in range(rng.randrange(12))]
    chunks = [rng.randrange(1, 5) for _ in range(7)]
    detok, updates = stream(
        smollm2, prompt, out, skip_special_tokens=skip_special_tokens, chunk_sizes=chunks
    )
    text = joined(updates) + detok.flush()
    assert text == smollm2.decode(out, skip_special_tokens=skip_special_tokens)


def test_special_tokens_follow_skip_special_tokens(smollm2) -> None:
    out = smollm2.encode("Hi<|im_end|>")
    for skip in (True, False):
        detok, updates = stream(smollm2, [], out, skip_special_tokens=skip)
        assert joined(updates) + detok.flush() == ("Hi" if skip else "Hi<|im_end|>")


def _spans_tokens(tokenizer, out: Sequence[int], stop: str) -> bool:
    return all(stop not in tokenizer.decode([t]) for t in out)


@pytest.mark.parametrize("chunk_sizes", [(1,), (3, 1), (1_000,)])
def test_stop_string_spanning_tokens_is_cut_exactly(smollm2, chunk_sizes) -> None:
    text = "The answer is forty-two, obviously. Then more text follows."
    stop = "forty-two"
    out = smollm2.encode(text)
    assert _spans_tokens(smollm2, out, stop)
    detok, updates = stream(
        smollm2, smollm2.encode(CHAT_PROMPT), out, [stop], chunk_sizes=chunk_sizes
    )
    assert updates[-1].stop_string == stop
    assert all(u.stop_string is None for u in updates[:-1])
    assert joined(updates) == detok.text == text[: text.index(stop)]
    assert detok.stop_string == stop and detok.finished
    assert detok.flush() == ""  # text past a stop string is dropped
    with pytest.raises(AssertionError):
        detok.update(smollm2.encode(" more"))


def test_stop_string_inside_one_token_is_cut_inside_it(smollm2) -> None:
    text = "A wonderful day."
    out = smollm2.encode(text)
    detok, updates = stream(smollm2, [], out, ["nderf"])
    assert updates[-1].stop_string == "nderf"
    assert joined(updates) == "A wo"


def test_stop_string_at_the_very_start(smollm2) -> None:
    text = "STOP right there, nothing else."
    detok, updates = stream(smollm2, smollm2.encode(CHAT_PROMPT), smollm2.encode(text), ["STOP"])
    assert updates[-1].stop_string == "STOP"
    assert joined(updates) == "" and detok.text == ""


@pytest.mark.parametrize("chunk_sizes", [(1,), (1_000,)])
def test_earliest_stop_string_wins(smollm2, chunk_sizes) -> None:
    text = "alpha beta gamma delta epsilon"
    out = smollm2.encode(text)
    detok, updates = stream(smollm2, [], out, ["delta", "gamma", "beta"], chunk_sizes=chunk_sizes)
    assert updates[-1].stop_string == "beta"
    assert joined(updates) == "alpha "
    # Two stop strings starting at the same place: the shorter completes first.
    detok, updates = stream(smollm2, [], out, ["beta gam", "beta"], chunk_sizes=chunk_sizes)
    assert updates[-1].stop_string == "beta"


def test_emoji_stop_string(smollm2) -> None:
    text = "ok 😀 done"
    detok, updates = stream(smollm2, [], smollm2.encode(text), ["😀"])
    assert updates[-1].stop_string == "😀"
    assert joined(updates) == "ok "


def test_held_back_text_is_released_by_flush(smollm2) -> None:
    text = "Nothing stops this sentence from ending."
    stop = "a stop string that never appears"
    detok, updates = stream(smollm2, [], smollm2.encode(text), [stop])
    held = len(stop) - 1
    assert all(u.stop_string is None for u in updates)
    assert detok.text == joined(updates) == text[: len(text) - held]
    assert detok.flush() == text[len(text) - held :]
    assert detok.text == text and detok.finished
    with pytest.raises(AssertionError):
        detok.update([42])


def test_flush_releases_a_dangling_half_character(smollm2) -> None:
    out = smollm2.encode("ok 😀")
    partial = out[:-1]  # the emoji's last byte never arrives
    assert smollm2.decode(partial).endswith(FFFD)
    detok, updates = stream(smollm2, [], partial)
    assert FFFD not in joined(updates)
    assert joined(updates) + detok.flush() == smollm2.decode(partial)


def test_prompt_ending_inside_a_character(smollm2) -> None:
    # Prompts may arrive as token ids, cut anywhere; the output then completes the character.
    ids = smollm2.encode("Say 😀 and 世界 now")
    for split in range(1, len(ids)):
        prompt, out = ids[:split], ids[split:]
        detok, updates = stream(smollm2, prompt, out)
        assert joined(updates) + detok.flush() == smollm2.decode(out)


def test_empty_stop_string_is_rejected(smollm2) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(smollm2, [], [""])


def _sentencepiece_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """A tiny Llama-2-like (normalizer + Strip) or Metaspace tokenizer with byte fallback."""
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world, this is a small corpus for a tiny tokenizer.",
        "Streaming text one token at a time is tricky; stop strings must be cut exactly.",
    ] * 10
    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if style == "llama2":
        trained.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        trained.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first")
        decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace("▁", prepend_scheme="first")]
        )
    specials = ["<unk>", "<s>", "</s>"]
    trained.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials)
    )
    vocab = trained.get_vocab()
    for byte in range(256):  # byte fallback: characters outside the vocab become <0xNN> tokens
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer, tokenizer.pre_tokenizer = trained.normalizer, trained.pre_tokenizer
    tokenizer.decoder = decoder
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module", params=["llama2", "metaspace"])
def sentencepiece(request) -> PreTrainedTokenizerFast:
    return _sentencepiece_tokenizer(request.param)


def test_sentencepiece_keeps_the_first_tokens_leading_space(sentencepiece) -> None:
    ids = sentencepiece.encode("Hello world, the fox 😀 says 世界 to a lazy dog.")
    full = sentencepiece.decode(ids, skip_special_tokens=True)
    num_spaced = 0
    for split in range(1, len(ids)):
        prompt, out = ids[:split], ids[split:]
        prompt_text = sentencepiece.decode(prompt, skip_special_tokens=True)
        if prompt_text.endswith(FFFD):
            continue  # a prompt made from text never ends inside a character
        assert full.startswith(prompt_text)
        expected = full[len(prompt_text) :]  # what the output adds to the prompt
        detok, updates = stream(sentencepiece, prompt, out)
        assert all(FFFD not in u.delta for u in updates)
        assert joined(updates) + detok.flush() == expected
        if sentencepiece.convert_ids_to_tokens(out[0]).startswith("▁"):
            # decode(out) alone drops that space; the prompt context is what keeps it.
            alone = sentencepiece.decode(out, skip_special_tokens=True)
            assert expected.startswith(" ") and not alone.startswith(" ")
            num_spaced += 1
    assert num_spaced >= 3


def test_sentencepiece_without_prompt_matches_decode(sentencepiece) -> None:
    out = sentencepiece.encode("Hello world 😀 世界, stop here.")
    detok, updates = stream(sentencepiece, [], out)
    assert joined(updates) + detok.flush() == sentencepiece.decode(out, skip_special_tokens=True)
    detok, updates = stream(sentencepiece, [], out, ["世界"])
    assert updates[-1].stop_string == "世界"
    assert joined(updates) == "Hello world 😀 "


@pytest.mark.parametrize("seed", range(3))
def test_sentencepiece_random_ids_stream_to_the_full_decode(sentencepiece, seed: int) -> None:
    # Random pieces (specials and <unk> included) and byte-fallback runs of random characters.
    # Not random bytes: HF's ByteFallback decoder turns a whole run of byte tokens into U+FFFDs
    # when any byte in it is invalid, so a later bad byte rewrites earlier, valid text.
    rng = random.Random(seed)
    vocab = sentencepiece.get_vocab()
    pieces = sorted(i for t, i in vocab.items() if not t.startswith("<0x"))
    chars = "😀🎉👍世界你好日本語é€ß" + "".join(
        chr(rng.randrange(0x80, 0x10FFFF)) for _ in range(20)
    )
    out: list[int] = []
    while len(out) < 200:
        if rng.random() < 0.6:
            out.append(rng.choice(pieces))
            continue
        char = rng.choice(chars)
        if 0xD800 <= ord(char) < 0xE000:
            continue  # surrogates have no UTF-8
        out.extend(vocab[f"<0x{b:02X}>"] for b in char.encode())
    detok, updates = stream(sentencepiece, [], out, chunk_sizes=[1, 2, 3])
    assert all(FFFD not in u.delta for u in updates)
    assert joined(updates) + detok.flush() == sentencepiece.decode(out, skip_special_tokens=True)


def _wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer with clean-up on: decode's clean-up pass changes its text."""
    trained = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    trained.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trained.decoder = decoders.WordPiece()
    trained.train_from_iterator(["Hello , world ! It ' s a test . Do n't stop ?"] * 5,
                                trainers.WordPieceTrainer(vocab_size=80,
                                                          special_tokens=["[UNK]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=trained, unk_token="[UNK]",
                                   sep_token="[SEP]", clean_up_tokenization_spaces=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_native_decode_equals_the_tokenizers_decode(smollm2, sentencepiece, seed: int) -> None:
    """The window decoder the router uses gives tokenizer.decode's text exactly, special tokens
    kept or skipped, for byte-level BPE, both sentencepiece styles and a WordPiece tokenizer
    whose clean-up pass must not be skipped."""
    wordpiece = _wordpiece_tokenizer()
    rng = random.Random(seed)
    for tokenizer in (smollm2, sentencepiece, wordpiece):
        decode = native_decode(tokenizer)
        for _ in range(200):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
            for skip in (True, False):
                assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip), ids
    assert wordpiece.decode(wordpiece.encode("It ' s")) != \
        wordpiece.backend_tokenizer.decode(wordpiece.encode("It ' s"))  # the clean-up matters
