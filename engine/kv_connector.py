"""KVConnector: the seam between the engine and whatever moves KV to or from other workers.

The split follows vLLM v1's KVConnectorBase_V1: one object, two sides, each called by one
part of the engine (both on the engine's loop thread).

Scheduler side (called by the Scheduler):
    reserve(request, block_ids)   blocks are held for a request whose prompt KV comes from
                                  elsewhere; returns what the other side pushes into (the
                                  transfer descriptor). Only a receiving connector accepts.
    poll()                        before each schedule: which of those transfers are ready
                                  (KV landed everywhere, first token known) and which failed
                                  or expired. The scheduler admits the first, ends the others
                                  (a pulled prefix: it queues the request for a local
                                  prefill of the rest either way, from scratch on failure).
    request_finished(request)     a request ended (finished, aborted, failed): whatever the
                                  connector still holds for it goes, before its blocks are freed.

Worker side (called by the ModelRunner around each forward pass):
    register_kv_caches(kv_caches) once, after the cache is allocated
    start_save(plan)              before the forward: what this step's KV is pushed for (the
                                  plan entry that completes a prompt carries `kv_transfer`)
    save_kv_layer(layer)          after each layer's K/V are stored: push it while the next
                                  layer computes
    wait_for_save()               after the forward: every byte has left (or failed), per
                                  request; only then does the scheduler release the blocks
    abort_save()                  the forward raised: tell the destinations, drain the sends

Each transfer has exactly one record per side, owned by the connector implementing this
(kvtransfer.receive_connector on decode, kvtransfer.push_connector on prefill). Loads never
block a layer here: a request is admitted only once its whole prompt KV has landed.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import KVSaveResult, SchedulerOutput, TokenLogprobs

if TYPE_CHECKING:  # the scheduler imports this module, and the scheduler imports no torch
    import torch

    from pdserve.kvtransfer.descriptor import Endpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemotePrefill:
    """A reserved request's `kv_transfer`: who pushes its prompt KV, and by when.

    `num_tokens` None: the whole prompt's KV and its first token come from a prefill worker.
    A number: a pull — the prompt's first `num_tokens` tokens (whole blocks, not the last
    token) come from another decode worker's prefix cache, and the rest is computed here."""

    sources: tuple[Endpoint, ...]  # the pushing ranks
    deadline: float  # time.time(): the reservation is reclaimed (a pull given up) then
    num_tokens: int | None = None

    @property
    def is_pull(self) -> bool:
        return self.num_tokens is not None


@dataclass(frozen=True)
class KVArrival:
    """A remote prompt's KV has landed on every rank, and its first token is known; or a
    pulled prefix has landed (`first_token` None: the rest of the prompt is computed here)."""

    request_id: str
    first_token: int | None
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class KVConnectorEvents:
    """What the connector learned since the scheduler last polled it."""

    ready: tuple[KVArrival, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()  # (request id, why): ends with an error


class KVConnector(abc.ABC):
    # ---- scheduler side ----

    @abc.abstractmethod
    def reserve(self, request: Request, block_ids: Sequence[int]) -> object:
        """`block_ids` are held for `request`, whose prompt KV comes from elsewhere
        (`request.kv_transfer` says from where, and by when); its first
        `request.num_cached_tokens` tokens (whole blocks) are this worker's prefix-cache hits,
        shared with other requests, and need no KV from elsewhere. Returns what the sender pushes
        into; raises ValueError to refuse (the scheduler then frees the blocks)."""

    @abc.abstractmethod
    def poll(self) -> KVConnectorEvents:
        """Reserved requests now ready to run, and those whose transfer failed or expired.
        Either way the connector has let go of them."""

    @abc.abstractmethod
    def request_finished(self, request: Request) -> None:
        """`request` ended (its status says how): drop what is held for it. Once this
        returns nothing writes into its blocks any more."""

    # ---- worker side ----

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: Sequence[tuple[torch.Tensor, ...]]) -> None:
        """The engine's KV cache, per layer (k, v[, k_scale, v_scale])."""

    @abc.abstractmethod
    def start_save(self, plan: SchedulerOutput) -> None:
        """This step's forward is about to run `plan`."""

    @abc.abstractmethod
    def save_kv_layer(self, layer: int) -> None:
        """Layer `layer`'s K/V of this step are in the cache."""

    @abc.abstractmethod
    def wait_for_save(self) -> dict[str, KVSaveResult]:
        """Block until this step's saves are done; how each request's went, by request id."""

    @abc.abstractmethod
    def abort_save(self) -> None:
        """This step's forward failed: its saves will never complete."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the transport; pending transfers fail."""
