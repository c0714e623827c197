"""The prefill worker's gRPC service (proto/worker.proto `PrefillWorker`): typed messages only.

`start_prefill_service(spec)` binds the port first (its address is the worker's identity in
every transfer descriptor), builds the worker, then serves. Blocking RPCs run on the server's
thread pool; the engine itself runs on the worker's loop thread.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures

import grpc

from pdserve.engine.wire import logprobs_to_proto, sampling_from_proto
from pdserve.engine.worker_spec import WorkerSpec
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.kvtransfer.rendezvous import GlooConnector
from pdserve.prefill_worker.prefix_events import PrefixIndexPublisher
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.proto import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

MAX_RPC_THREADS = 64


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, worker_id: str) -> None:
        self.worker, self.worker_id = worker, worker_id

    def Prefill(self, request, context):
        rid = request.request_id
        try:
            descriptor = TransferDescriptor.decode(request.descriptor)
            params = sampling_from_proto(request.sampling, default_max_tokens=1)
            future = self.worker.prefill(rid, list(request.prompt_token_ids), params, descriptor)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        context.add_callback(lambda: future.done() or self.worker.abort(rid))
        try:
            result = future.result(timeout=max(descriptor.deadline - time.time(), 0.0))
        except futures.TimeoutError:
            self.worker.abort(rid)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid} missed deadline")
        except Exception as exc:  # transfer failed, aborted, or the worker died
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill of {rid} failed: {exc}")
        response = worker_pb2.PrefillResponse(
            first_token_id=result.first_token, num_cached_tokens=result.num_cached_tokens,
            transfer_bytes=result.transfer_bytes, transfer_s=result.transfer_s,
        )
        if result.logprobs is not None:
            response.logprob.CopyFrom(logprobs_to_proto(result.logprobs))
        return response

    def Abort(self, request, context):
        self.worker.abort(request.request_id)
        return worker_pb2.WorkerAbortResponse(found=True)

    def GetLoad(self, request, context):
        s = self.worker.stats()
        return worker_pb2.WorkerLoad(
            worker_id=self.worker_id, num_blocks=s.num_blocks,
            num_free_blocks=s.num_free_blocks, num_used_blocks=s.num_used_blocks,
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_cached_blocks=s.num_cached_blocks, max_num_seqs=s.max_num_seqs,
            block_size=s.block_size, tp_size=s.tp_size,
        )


class PrefillService:
    """A PrefillWorker behind its gRPC server; `address` is what the router dials."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(MAX_RPC_THREADS,
                                                             thread_name_prefix="prefill-rpc"))
        self.port = self.server.add_insecure_port(f"{spec.host}:0")
        self.address = f"{spec.host}:{self.port}"
        self.publisher = None
        if spec.redis_url:
            self.publisher = PrefixIndexPublisher(
                spec.redis_url, spec.redis_password, spec.redis_namespace, spec.worker_id
            )
        self.worker = PrefillWorker(
            spec.engine_config(), GlooConnector(Endpoint(spec.host, self.port, 0)),
            spec.model_name, self.publisher,
        )
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(
            PrefillServicer(self.worker, spec.worker_id), self.server
        )
        self.server.start()
        logger.info("prefill worker %s serving on %s", spec.worker_id, self.address)

    def stop(self) -> None:
        self.server.stop(grace=1.0).wait()
        self.worker.close()
        if self.publisher is not None:
            self.publisher.close()
