"""Start one rank of a decode tensor-parallel group: rank 0 serves, the others follow."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pdserve.decode_worker.follower import run_follower
from pdserve.decode_worker.worker import MAX_RESERVATION_S, TP_BEAT_S, DecodeWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.spec.make import sized
from pdserve.kvtransfer.connector import Connector, Listener
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.layout import KVLayout, transfer_view
from pdserve.kvtransfer.receiver import KVReceiver


def start_decode_rank(
    config: EngineConfig,
    tp: TensorParallel,
    listener: Listener,
    endpoints: Sequence[Endpoint],
    model_name: str,
    *,
    max_reservation_s: float = MAX_RESERVATION_S,
    tp_beat_s: float = TP_BEAT_S,
    transport: Connector | None = None,
) -> DecodeWorker | None:
    """Rank 0: the running DecodeWorker (pushing prefixes through `transport`, TP 1 only).
    Other ranks: serve until rank 0 stops; None."""
    if tp.rank == 0:
        return DecodeWorker(config, listener, endpoints, model_name, tp,
                            max_reservation_s=max_reservation_s, tp_beat_s=tp_beat_s,
                            transport=transport)
    config = sized(config)  # the block count rank 0 has (a draft model's KV shares blocks)
    runner = ModelRunner(replace(config, speculative=None), tp)
    layout = KVLayout.from_model_config(config.model, config.cache.block_size, model_name)
    receiver = KVReceiver(layout, listener, tp.size, transfer_view(layout, runner.kv_caches))
    run_follower(runner, tp, receiver)
    return None
