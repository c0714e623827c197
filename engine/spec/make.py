"""Building speculation from an EngineConfig: the draft model's config, the KV pool sized for
both models, and the Speculator with its proposer."""

from __future__ import annotations

from dataclasses import replace

from pdserve.engine.config import EngineConfig, ModelConfig, load_model_config, with_num_blocks
from pdserve.engine.default_model import resolve_model
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.spec.speculator import Speculator


def draft_model_config(config: EngineConfig) -> ModelConfig | None:
    """The draft model's config (the target's dtype and context window), or None."""
    spec = config.speculative
    if spec is None or spec.method != "draft":
        return None
    model = config.model
    draft = load_model_config(resolve_model(spec.model), model.dtype, model.max_model_len)
    if draft.vocab_size != model.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocab_size {draft.vocab_size} differs from "
            f"the target's {model.vocab_size}; a draft needs the target's tokenizer"
        )
    return draft


def sized(config: EngineConfig) -> EngineConfig:
    """The config with its KV block count derived (each block holds the draft's KV too)."""
    return replace(config, cache=with_num_blocks(config.cache, config.model,
                                                 draft_model_config(config)))


def make_speculator(config: EngineConfig, kv_cache: KVCacheManager) -> Speculator | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from pdserve.engine.spec.ngram import NgramProposer

        proposer = NgramProposer(spec)
    else:
        from pdserve.engine.spec.draft import DraftProposer

        proposer = DraftProposer(config, draft_model_config(config), kv_cache)
    return Speculator(spec, proposer, config.model.max_model_len)
