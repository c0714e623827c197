"""Drive a prefill worker and a decode worker the way the router will: reserve on decode,
prefill into the reservation, start decode with the first token, stream the rest."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator

from pdserve.cluster_secret import ClusterSecret
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
    load_model_config,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.loopback import LoopbackHub
from pdserve.prefill_worker.worker import PrefillWorker

MODEL_NAME = "tiny-llama"
SECRET = ClusterSecret(b"tests-workers-cluster-secret-0123456789")  # the worker plane's, in tests


def engine_config(model_dir, num_blocks: int = 256, block_size: int = 16) -> EngineConfig:
    """The workers' engine: LoRA enabled (two adapters per step), as a request may ask."""
    return EngineConfig(
        model=load_model_config(model_dir, max_model_len=512),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
        num_threads=1,
        lora=LoRAConfig(max_loras=2, max_lora_rank=16),
    )


@contextlib.contextmanager
def loopback_pair(model_dir) -> Iterator[tuple]:
    """(prefill worker, decode worker) in this process, KV over the loopback transport."""
    hub = LoopbackHub()
    decode_ep = Endpoint("127.0.0.1", 9, 0)
    decode = DecodeWorker(engine_config(model_dir), hub.listener(decode_ep, secret=SECRET),
                          [decode_ep], MODEL_NAME)
    prefill = PrefillWorker(engine_config(model_dir), hub.connector(
        Endpoint("127.0.0.1", 8, 0), secret=SECRET), MODEL_NAME)
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


class Streams:
    """Per-request views of a decode worker's step batches (the router does this over gRPC)."""

    def __init__(self, decode) -> None:
        self.decode = decode
        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue] = defaultdict(queue.Queue)

    def collect(self, request_id: str, timeout: float = 60.0):
        """(every token id, the last output) of one request."""
        deadline, tokens = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            with self._lock:
                q = self._queues[request_id]
                if q.empty():  # one reader at a time pulls the next batch and sorts it
                    for out in self.decode.next_outputs(timeout=0.05):
                        self._queues[out.request_id].put(out)
            while not q.empty():
                out = q.get()
                tokens.extend(out.token_ids)
                if out.finished:
                    with self._lock:
                        self._queues.pop(request_id, None)
                    return tokens, out
        raise TimeoutError(f"{request_id}: no last output within {timeout} s")


_STREAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def streams(decode) -> Streams:
    if decode not in _STREAMS:
        _STREAMS[decode] = Streams(decode)
    return _STREAMS[decode]


def generate_pd(prefill, decode, request_id, prompt, params: SamplingParams, timeout=60.0):
    """Token ids of one request served disaggregated; raises on refusal or failure."""
    deadline = time.time() + timeout
    descriptor = decode.reserve(request_id, prompt, params, [prefill.endpoint], deadline)
    if descriptor is None:
        raise RuntimeError(f"{request_id}: decode refused the reservation")
    first = prefill.prefill(request_id, prompt, params, descriptor).result(timeout)
    decode.start(request_id, first.first_token, first.logprobs)
    tokens, last = streams(decode).collect(request_id, timeout)
    if last.finish_reason == "error":
        raise RuntimeError(f"{request_id}: {last.error}")
    return tokens


def run_engine(core, prompts, params: SamplingParams, loras=None) -> list[list[int]]:
    """Every prompt through one in-process EngineCore (the reference the workers must match),
    each with its LoRA adapter of `loras` (None: the base model)."""
    from pdserve.engine.request import Request

    loras = loras or [None] * len(prompts)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        core.add_request(Request(f"r{i}", tuple(prompt), params, lora=lora))
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))]
