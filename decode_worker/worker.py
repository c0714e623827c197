"""DecodeWorker: rank 0 of a decode group — reservations, KV arrival, batching, streams.

Admission is memory reservation: `reserve` holds blocks for a prompt (or refuses, holding
nothing) and returns the TransferDescriptor the prefill worker pushes into. A request joins
the running batch once its KV has landed on every TP rank and its first token (sampled by
prefill) is known. Every reservation has a deadline; a failed or late transfer, an abort or a
finish frees the request's blocks on every rank. All engine and TP-group work happens on the
worker's own loop thread; the public methods are thread-safe and only queue commands.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from decode_worker.outputs import DecodeOutput
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.models.parallel import TensorParallel
from engine.plan_broadcast import publish
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from kvtransfer.connector import Listener
from kvtransfer.descriptor import Endpoint, TransferDescriptor
from kvtransfer.layout import KVLayout
from kvtransfer.receiver import KVReceiver

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005


@dataclass
class _Pending:
    descriptor: TransferDescriptor
    landed: bool = False  # complete on rank 0
    first_token: int | None = None


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
        self._streams: dict[str, queue.Queue[DecodeOutput]] = {}
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

    def start(self, request_id: str, first_token: int) -> None:
        """The prefill side's first token: the request runs once its KV has landed."""
        self._call(lambda: self._start(request_id, first_token))

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        return self._call(lambda: self._finish(request_id, "abort", reason))

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[DecodeOutput]:
        """This request's outputs as they come, the last one finished."""
        q = self._streams.get(request_id)
        if q is None:
            raise ValueError(f"request_id {request_id!r} is not reserved here")
        while True:
            out = q.get(timeout=timeout)
            if out.finished:
                self._streams.pop(request_id, None)
            yield out
            if out.finished:
                return

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
        except Exception as exc:  # end every stream with the reason rather than hang them
            logger.exception("decode loop failed")
            for request_id in list(self._streams):
                self._deliver(DecodeOutput(request_id, (), "error", f"decode worker died: {exc}"))

    def _serve(self) -> None:
        scheduler = self.core.scheduler
        while not self._stop.is_set():
            self._run_commands()
            self._settle_transfers()
            if scheduler.running or scheduler.waiting:
                for out in self.core.step():
                    self._deliver(DecodeOutput(out.request_id, out.new_token_ids,
                                               out.finish_reason))
            else:
                with contextlib.suppress(queue.Empty):
                    self._commands.get(timeout=IDLE_WAIT_S)()

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
        self._streams[request_id] = queue.Queue()
        return descriptor

    def _start(self, request_id: str, first_token: int) -> None:
        pending = self._pending.get(request_id)
        if pending is None:
            raise ValueError(f"request_id {request_id!r} has no reservation here")
        if not 0 <= first_token < self.config.model.vocab_size:
            raise ValueError(f"first_token {first_token} is outside the vocabulary")
        pending.first_token = first_token

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
            out = self.core.scheduler.admit_remote(rid, pending.first_token)
            self._deliver(DecodeOutput(rid, out.new_token_ids, out.finish_reason))

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
        q = self._streams.get(out.request_id)  # kept until its reader takes the last output
        if q is not None:
            q.put(out)

    def _stats(self) -> dict[str, int]:
        kv = self.core.kv_cache
        return {
            "num_blocks": kv.pool.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "num_running": len(self.core.scheduler.running),
            "num_reserved": len(self._pending),
        }

    def _shutdown(self) -> None:
        for rid in list(self._pending):
            self._finish(rid, "abort", "decode worker shutting down")
        self.core.shutdown()
        self.receiver.close()
