"""Turn a user prompt into validated token ids before anything is allocated. No torch.

The router runs the same checks, so a request that would be refused never reaches a worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdserve.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


def tokenize_prompt(prompt: Prompt, tokenizer: Any, vocab_size: int) -> list[int]:
    """Token ids of a text prompt, or the checked ids of a token prompt."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("prompt: text needs a tokenizer, and none was loaded "
                             "(skip_tokenizer_init=True): pass token ids")
        return list(tokenizer(prompt).input_ids)
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError("prompt must be a str or a list of token ids, got bytes")
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt_token_ids must not be empty")
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise ValueError(f"prompt_token_ids must be integers, got {token_id!r}")
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"prompt_token_ids: token id {token_id} is outside the vocabulary "
                f"[0, {vocab_size})"
            )
    return ids


def chat_prompt(messages: Sequence[dict[str, Any]], tokenizer: Any,
                tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of `messages` under the model's chat template, ready for the reply; `tools`
    (OpenAI's function dicts) go to the template, which renders them as it was trained."""
    if not messages:
        raise ValueError("messages must not be empty")
    if tokenizer is None:
        raise ValueError("messages: a chat needs the tokenizer's template, and none was "
                         "loaded (skip_tokenizer_init=True): pass token ids")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role'")
        if not message["role"]:
            raise ValueError(f"messages[{i}].role must not be empty")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                         tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt is {num_prompt_tokens} tokens; max_model_len is {max_model_len} "
            "(prompt plus at least one generated token must fit)"
        )


def prepare_params(params: SamplingParams, tokenizer: Any, vocab_size: int) -> SamplingParams:
    """The params with every token id checked against the vocabulary, `bad_words` turned
    into token ids (so a worker without a tokenizer takes them) and the structured output
    checked (it compiles later, on the engine's compiler)."""
    for name, ids in (("stop_token_ids", params.stop_token_ids),
                      ("logit_bias", [t for t, _ in params.logit_bias]),
                      ("bad_words_token_ids", [t for w in params.bad_words_token_ids for t in w])):
        for token_id in ids:
            if token_id >= vocab_size:
                raise ValueError(f"{name}: {token_id} is outside the vocabulary [0, {vocab_size})")
    if params.structured_outputs is not None:
        from pdserve.engine.structured_output import check_structured_outputs  # xgrammar: lazy

        check_structured_outputs(params.structured_outputs)
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise ValueError("bad_words: words need a tokenizer, and none was loaded "
                         "(skip_tokenizer_init=True)")
    return replace(params, bad_words=(), bad_words_token_ids=params.bad_words_token_ids
                   + bad_words_token_ids(params.bad_words, tokenizer))


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """Each word as tokens at the start of a text and, where that tokenizes differently,
    after a space (mid-text), so both forms are banned."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
            if tokens and tokens not in out:
                out.append(tokens)
    return tuple(out)
