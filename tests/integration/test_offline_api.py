"""vLLM's offline tokenizer options: `tokenizer=PATH`, `skip_tokenizer_init=True`, and a clear
error for a checkpoint directory that has no tokenizer files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.tokenizer import has_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE = {"num_kv_blocks": 32, "max_model_len": 256, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def weights_only_dir(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    """The tiny checkpoint's config and weights, without its tokenizer files."""
    out = tmp_path_factory.mktemp("weights-only")
    for path in tiny_llama_dir.iterdir():
        if path.suffix in (".json", ".safetensors") and "token" not in path.name:
            shutil.copy(path, out / path.name)
    assert (out / "config.json").is_file() and not has_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path):
    return LLM(str(tiny_llama_dir), **ENGINE).generate(["The capital of France is"], GREEDY)[0]


def test_missing_tokenizer_names_both_ways_out(weights_only_dir: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer files") as err:
        LLM(str(weights_only_dir), **ENGINE)
    assert "tokenizer=PATH" in str(err.value) and "skip_tokenizer_init=True" in str(err.value)


def test_tokenizer_from_another_directory(weights_only_dir, tiny_llama_dir, reference) -> None:
    llm = LLM(str(weights_only_dir), tokenizer=str(tiny_llama_dir), **ENGINE)
    out = llm.generate(["The capital of France is"], GREEDY)[0]
    assert out.token_ids == reference.token_ids and out.text == reference.text != ""


def test_tokenizer_path_must_hold_a_tokenizer(weights_only_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^tokenizer: .* is not a directory"):
        LLM(str(weights_only_dir), tokenizer=str(tmp_path / "absent"), **ENGINE)
    with pytest.raises(ValueError, match="^tokenizer: .* has no tokenizer files"):
        LLM(str(weights_only_dir), tokenizer=str(weights_only_dir), **ENGINE)


def test_skip_tokenizer_init_generates_token_ids(weights_only_dir, reference) -> None:
    llm = LLM(str(weights_only_dir), skip_tokenizer_init=True, **ENGINE)
    assert llm.tokenizer is None
    out = llm.generate([list(reference.prompt_token_ids)], GREEDY)[0]
    assert out.token_ids == reference.token_ids and out.text == ""
    stop_id = reference.token_ids[3]
    cut = llm.generate([list(reference.prompt_token_ids)],
                       SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]))[0]
    assert cut.token_ids == reference.token_ids[: reference.token_ids.index(stop_id) + 1]


def test_skip_tokenizer_init_refuses_text(weights_only_dir: Path) -> None:
    llm = LLM(str(weights_only_dir), skip_tokenizer_init=True, **ENGINE)
    with pytest.raises(ValueError, match="^prompt: text needs a tokenizer"):
        llm.generate(["hello"])
    with pytest.raises(ValueError, match="^stop: stop strings need a tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="^messages: a chat needs"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert not llm.engine.has_unfinished_requests()
