"""Find and load a model's tokenizer. No torch: the router loads it too.

The tokenizer comes from the model directory unless another directory is named (vLLM's
`tokenizer=`); a directory without tokenizer files is refused with both ways out named,
instead of transformers' error about a missing vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Any one of these makes a directory loadable by AutoTokenizer (fast, sentencepiece, BPE).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_path: str | Path, tokenizer: str | Path | None = None) -> Any:
    """The HF tokenizer at `tokenizer` (a directory), else the one beside the weights."""
    from transformers import AutoTokenizer

    source = Path(tokenizer if tokenizer is not None else model_path).expanduser()
    if not source.is_dir():
        raise ValueError(f"tokenizer: {source} is not a directory")
    if not has_tokenizer(source):
        where = "tokenizer" if tokenizer is not None else "model"
        raise ValueError(
            f"{where}: {source} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
            "pass tokenizer=PATH to a directory that has them, or skip_tokenizer_init=True to "
            "send token ids only"
        )
    return AutoTokenizer.from_pretrained(str(source))
