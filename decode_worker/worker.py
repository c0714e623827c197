"""DecodeWorker: rank 0 of a decode group — reservations, KV arrival, batching, streams.

Admission is memory reservation: `reserve` holds blocks for a prompt (or refuses, holding
nothing) and returns the TransferDescriptor the prefill worker pushes into. A request joins
the running batch once its KV has landed on every TP rank and its first token (sampled by
prefill) is known. `submit` instead prefills a prompt here (when this worker's prefix cache
already holds most of it, e.g. the next turn of a session). Every reservation has a deadline;
a failed or late transfer, an abort or a finish frees the request's blocks on every rank.
Outputs leave as one batch per engine step (`next_outputs`), every request's news together.
All engine and TP-group work happens on the worker's own loop thread; the public methods are
thread-safe and only queue commands.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from pdserve.decode_worker.outputs import DecodeOutput
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.plan_broadcast import publish
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import TokenLogprobs
from pdserve.kvtransfer.connector import Listener
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.receiver import KVReceiver

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005


@dataclass
class _Pending:
    descriptor: TransferDescriptor
    landed: bool = False  # complete on rank 0
    first_token: int | None = None
    logprobs: TokenLogprobs | None = None


class DecodeWorker:
    def __init__(
        self,
        config: EngineConfig,
        listener: Listener,
        endpoints: Sequence[Endpoint],
        model_name: str,
        tp: TensorParallel | None = None,
    ) -> None:
        self.core = EngineCore(config, tp)
        self.tp = self.core.tp
        self.config = self.core.config
        self.endpoints = tuple(endpoints)
        assert len(self.endpoints) == self.tp.size, "one listening endpoint per TP rank"
        self.layout = KVLayout.from_model_config(
            self.config.model, self.config.cache.block_size, model_name
        )
        kv_caches = [kv[:2] for kv in self.core.runner.kv_caches]
        self.receiver = KVReceiver(self.layout, listener, self.tp.size, kv_caches)
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._active: set[str] = set()  # reserved or submitted, last output not yet delivered
        self._step_outputs: list[DecodeOutput] = []
        self._outputs: queue.Queue[tuple[DecodeOutput, ...]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self._thread.start()

    # ---- public, thread-safe ----

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        sources: Sequence[Endpoint],
        deadline: float,
    ) -> TransferDescriptor | None:
        """Hold blocks for the prompt's KV; the descriptor to push into, or None if full."""
        return self._call(
            lambda: self._reserve(request_id, prompt_token_ids, params, sources, deadline)
        )

    def start(
        self, request_id: str, first_token: int, logprobs: TokenLogprobs | None = None
    ) -> None:
        """The prefill side's first token: the request runs once its KV has landed."""
        self._call(lambda: self._start(request_id, first_token, logprobs))

    def submit(self, request_id: str, prompt_token_ids: Sequence[int],
               params: SamplingParams) -> bool:
        """Prefill and decode here (prefix cache first); False, holding nothing, when full."""
        return self._call(lambda: self._submit(request_id, prompt_token_ids, params))

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        return self._call(lambda: self._finish(request_id, "abort", reason))

    def next_outputs(self, timeout: float | None = None) -> tuple[DecodeOutput, ...]:
        """The next step's outputs (every request with news), or () after `timeout` seconds."""
        try:
            return self._outputs.get(timeout=timeout)
        except queue.Empty:
            return ()

    def is_alive(self) -> bool:
        """Whether the engine loop still runs (a dead loop serves nothing)."""
        return self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        return self._call(self._stats)

    def close(self) -> None:
        if not self._stop.is_set():
            self._call(self._shutdown)
            self._stop.set()
            self._thread.join(timeout=30)

    # ---- loop thread ----

    def _call(self, fn: Callable[[], object]):
        if self._stop.is_set():
            raise RuntimeError("decode worker is closed")
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._commands.put(run)
        while True:  # never hang on a loop that has died
            try:
                return future.result(timeout=0.1)
            except FutureTimeout:
                if not self._thread.is_alive():
                    raise RuntimeError("decode worker loop has stopped") from None

    def _loop(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # end every request with the reason rather than hang it
            logger.exception("decode loop failed")
            for request_id in list(self._active):
                self._deliver(DecodeOutput(request_id, (), "error", f"decode worker died: {exc}"))
            self._flush()

    def _serve(self) -> None:
        scheduler = self.core.scheduler
        while not self._stop.is_set():
            self._run_commands()
            self._settle_transfers()
            if scheduler.running or scheduler.waiting:
                for out in self.core.step():
                    self._deliver(DecodeOutput.from_core(out))
            else:
                with contextlib.suppress(queue.Empty):
                    self._commands.get(timeout=IDLE_WAIT_S)()
            self._flush()

    def _run_commands(self) -> None:
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _reserve(self, request_id, prompt_token_ids, params, sources, deadline):
        request = Request(
            request_id, tuple(prompt_token_ids), params, self.config.model.eos_token_ids
        )
        block_ids = self.core.scheduler.reserve_remote(request)
        if block_ids is None:
            return None
        try:
            descriptor = TransferDescriptor.new(
                request_id, self.layout, sources,
                [(ep, block_ids) for ep in self.endpoints], deadline,
            )
            if self.tp.size > 1:
                publish(self.tp, "expect", {"descriptor": descriptor.encode().decode()})
            self.receiver.expect(descriptor)
        except BaseException:
            self.core.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
            raise
        self._pending[request_id] = _Pending(descriptor)
        self._active.add(request_id)
        return descriptor

    def _submit(self, request_id, prompt_token_ids, params) -> bool:
        scheduler = self.core.scheduler
        if request_id in scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        num_seqs = len(scheduler.running) + len(scheduler.waiting) + len(scheduler.remote)
        if num_seqs >= self.config.scheduler.max_num_seqs:
            return False
        self.core.add_request(Request(
            request_id, tuple(prompt_token_ids), params, self.config.model.eos_token_ids
        ))
        self._active.add(request_id)
        return True

    def _start(self, request_id: str, first_token: int, logprobs: TokenLogprobs | None) -> None:
        pending = self._pending.get(request_id)
        if pending is None:
            raise ValueError(f"request_id {request_id!r} has no reservation here")
        if not 0 <= first_token < self.config.model.vocab_size:
            raise ValueError(f"first_token {first_token} is outside the vocabulary")
        pending.first_token = first_token
        pending.logprobs = logprobs

    def _settle_transfers(self) -> None:
        """Fail what failed or expired; admit what has landed everywhere with its token."""
        if not self._pending:
            return
        events = self.receiver.poll()
        by_transfer = {p.descriptor.transfer_id: rid for rid, p in self._pending.items()}
        for transfer_id in events.completed:
            if transfer_id in by_transfer:
                self._pending[by_transfer[transfer_id]].landed = True
        for error in events.failed:
            for transfer_id in error.transfer_ids:
                if transfer_id in by_transfer:
                    self._finish(by_transfer[transfer_id], "error", str(error))
        now = time.time()
        for rid, pending in list(self._pending.items()):
            if now > pending.descriptor.deadline and not (pending.landed and pending.first_token
                                                          is not None):
                self._finish(rid, "error", "reservation expired before its KV and first token")
        ready = [rid for rid, p in self._pending.items() if p.landed and p.first_token is not None]
        if ready:
            self._admit(ready)

    def _admit(self, request_ids: list[str]) -> None:
        if self.tp.size > 1:  # every rank must hold its shard before the request runs
            descriptors = [self._pending[r].descriptor for r in request_ids]
            transfers = [[d.transfer_id.hex(), d.deadline] for d in descriptors]
            publish(self.tp, "admit", {"transfers": transfers})
            failed = self.tp.all_reduce(torch.zeros(len(request_ids), dtype=torch.int64))
        else:
            failed = torch.zeros(len(request_ids), dtype=torch.int64)
        for rid, bad in zip(request_ids, failed.tolist()):
            if bad:
                self._finish(rid, "error", "KV transfer failed on another TP rank")
                continue
            pending = self._pending.pop(rid)
            out = self.core.scheduler.admit_remote(rid, pending.first_token, pending.logprobs)
            self._deliver(DecodeOutput.from_core(out))

    def _finish(self, request_id: str, reason: str, detail: str) -> bool:
        """End a request now (abort / error), freeing its blocks on every rank."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            transfer_id = pending.descriptor.transfer_id
            self.receiver.cancel(transfer_id, detail)
            if self.tp.size > 1:
                publish(self.tp, "cancel", {"transfer": transfer_id.hex(), "reason": detail})
        found = self.core.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if found:
            logger.info("request %s ended: %s (%s)", request_id, reason, detail)
            self._deliver(DecodeOutput(request_id, (), reason, detail if reason == "error"
                                       else None))
        return found

    def _deliver(self, out: DecodeOutput) -> None:
        if out.request_id in self._active:  # at most one last output per request
            self._step_outputs.append(out)
            if out.finished:
                self._active.discard(out.request_id)

    def _flush(self) -> None:
        if self._step_outputs:
            self._outputs.put(tuple(self._step_outputs))
            self._step_outputs = []

    def _stats(self) -> dict[str, int]:
        kv, scheduler = self.core.kv_cache, self.core.scheduler
        return {
            "num_blocks": kv.pool.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "num_used_blocks": kv.pool.num_blocks - kv.num_free_blocks,
            "num_cached_blocks": kv.pool.num_cached_blocks,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_reserved": len(self._pending),
            "max_num_seqs": self.config.scheduler.max_num_seqs,
            "block_size": self.config.cache.block_size,
            "tp_size": self.tp.size,
        }

    def _shutdown(self) -> None:
        for rid in list(self._pending):
            self._finish(rid, "abort", "decode worker shutting down")
        self.core.shutdown()
        self.receiver.close()
