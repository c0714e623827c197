"""Engine types <-> their protobuf messages (proto/pdserve.proto), shared by router and workers.

A worker trusts no field it receives (an authenticated caller can still be buggy): the
`check_*` functions below raise ValueError naming the field, which the worker answers as
INVALID_ARGUMENT before anything is queued, so a bad message never reaches an engine loop.
No torch here: the router imports it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pdserve.engine.input_processor import check_prompt_length, tokenize_prompt
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import TokenLogprobs
from pdserve.engine.structured_outputs_params import StructuredOutputsParams
from pdserve.proto import pdserve_pb2, worker_pb2

MAX_REQUEST_ID_CHARS = 256  # a transfer descriptor's limit (kvtransfer.descriptor)


def check_request_id(request_id: str) -> str:
    """A worker-side request id: 1..256 printable characters (it lands in logs)."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters, got "
                         f"{len(request_id) if isinstance(request_id, str) else request_id!r}")
    if not request_id.isprintable():
        raise ValueError(f"request_id must be printable, got {request_id[:64]!r}")
    return request_id


def check_prompt(token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> tuple[int, ...]:
    """Prompt ids in [0, vocab_size), not empty, leaving room for one generated token."""
    ids = tokenize_prompt(list(token_ids), None, vocab_size)
    check_prompt_length(len(ids), max_model_len)
    return tuple(ids)


def check_token_id(name: str, token_id: int, vocab_size: int) -> int:
    if isinstance(token_id, bool) or not isinstance(token_id, int) or not (
            0 <= token_id < vocab_size):
        raise ValueError(f"{name} {token_id!r} is outside the vocabulary [0, {vocab_size})")
    return token_id


def check_logprobs(lp: TokenLogprobs, vocab_size: int) -> TokenLogprobs:
    """A first token's logprobs as prefill sent them: ids in the vocabulary, no NaN."""
    check_token_id("logprob.token_id", lp.token_id, vocab_size)
    if len(lp.top) > SamplingParams.MAX_LOGPROBS:
        raise ValueError(f"logprob.top has {len(lp.top)} entries, at most "
                         f"{SamplingParams.MAX_LOGPROBS}")
    for token_id, logprob in ((lp.token_id, lp.logprob), *lp.top):
        check_token_id("logprob.top.token_id", token_id, vocab_size)
        if math.isnan(logprob) or logprob > 0:
            raise ValueError(f"logprob of token {token_id} must be <= 0, got {logprob}")
    return lp


def sampling_from_proto(msg: pdserve_pb2.SamplingParams, default_max_tokens: int) -> SamplingParams:
    """The request's SamplingParams; unset fields take the defaults. ValueError names a field."""
    defaults = SamplingParams()

    def get(name: str) -> Any:
        return getattr(msg, name) if msg.HasField(name) else getattr(defaults, name)

    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        **{name: get(name) for name in _OPTIONAL},
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logit_bias=dict(msg.logit_bias),
        bad_words=tuple(msg.bad_words),
        bad_words_token_ids=tuple(tuple(w.ids) for w in msg.bad_words_token_ids),
        structured_outputs=_structured_from_proto(msg),
    )


# Optional scalars: unset takes SamplingParams' default.
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "skip_special_tokens",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
             "prompt_logprobs")


def _structured_from_proto(msg: pdserve_pb2.SamplingParams) -> StructuredOutputsParams | None:
    if not msg.HasField("structured_outputs"):
        return None
    spec = msg.structured_outputs
    kind = spec.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs: set one of json, regex, choice, grammar, "
                         "json_object")
    value = getattr(spec, kind)
    return StructuredOutputsParams(**{kind: tuple(value.choices) if kind == "choice" else value})


def sampling_to_proto(params: SamplingParams) -> pdserve_pb2.SamplingParams:
    msg = pdserve_pb2.SamplingParams(
        max_tokens=params.max_tokens, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        logit_bias=dict(params.logit_bias), bad_words=list(params.bad_words),
        bad_words_token_ids=[pdserve_pb2.TokenIds(ids=w) for w in params.bad_words_token_ids],
    )
    for name in _OPTIONAL:
        if (value := getattr(params, name)) is not None:
            setattr(msg, name, value)
    spec = params.structured_outputs
    if spec is not None:
        value = getattr(spec, spec.kind)
        if spec.kind == "choice":
            msg.structured_outputs.choice.choices.extend(value)
        else:
            setattr(msg.structured_outputs, spec.kind, value)
    return msg


def logprobs_to_proto(lp: TokenLogprobs) -> pdserve_pb2.TokenLogprob:
    return pdserve_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[pdserve_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top], rank=lp.rank,
    )


def logprobs_from_proto(msg: pdserve_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top),
                         msg.rank if msg.HasField("rank") else None)


def lora_from_proto(request: Any) -> LoRARequest | None:
    """The adapter a worker request (Prefill, Reserve, Submit) names in its `lora` field, if
    set; ValueError naming a bad field."""
    if not request.HasField("lora"):
        return None
    return LoRARequest(request.lora.name, request.lora.id, request.lora.path)


def lora_to_proto(lora: LoRARequest | None) -> worker_pb2.LoRAAdapter | None:
    if lora is None:
        return None
    return worker_pb2.LoRAAdapter(name=lora.lora_name, id=lora.lora_int_id, path=lora.lora_path)
