"""Engine types <-> their protobuf messages (proto/pdserve.proto), shared by router and workers.

No torch here: the router imports it.
"""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import TokenLogprobs
from pdserve.proto import pdserve_pb2


def sampling_from_proto(msg: pdserve_pb2.SamplingParams, default_max_tokens: int) -> SamplingParams:
    """The request's SamplingParams; unset fields take the defaults. ValueError names a field."""
    defaults = SamplingParams()
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else defaults.top_k,
        min_p=msg.min_p if msg.HasField("min_p") else defaults.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        skip_special_tokens=(msg.skip_special_tokens if msg.HasField("skip_special_tokens")
                             else defaults.skip_special_tokens),
    )


def sampling_to_proto(params: SamplingParams) -> pdserve_pb2.SamplingParams:
    msg = pdserve_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, min_p=params.min_p, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def logprobs_to_proto(lp: TokenLogprobs) -> pdserve_pb2.TokenLogprob:
    return pdserve_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[pdserve_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
    )


def logprobs_from_proto(msg: pdserve_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))
