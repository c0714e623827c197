"""LayerLoads: one step's KV tier loads (host -> device), landing layer by layer beside the step.

The loader thread (engine.kv_offload) copies every loaded block's layer 0, marks it landed,
then layer 1, and so on, while the step's forward runs: the forward waits for layer i's loads
just before layer i reads its KV (`wait`, called through the step's AttentionMetadata), so the
copies of later layers overlap the earlier layers' compute, as the KV push does on the way out.
On CUDA the copies run on the loader's stream and `wait` makes the compute stream wait for
that layer's event, so the host never blocks on the GPU.

A load that fails fails every wait, and so the step (its requests end with an error): a block
that never landed is never attended to. `settle` waits for every layer without raising, so the
loaded blocks are no longer written once the step is over, however it ended.
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)

LOAD_WAIT_S = 120.0  # a loader stuck this long fails the step instead of wedging it


class LayerLoads:
    def __init__(self, num_layers: int) -> None:
        self._landed = [threading.Event() for _ in range(num_layers)]
        self._events: list[torch.cuda.Event | None] = [None] * num_layers
        self._error: BaseException | None = None

    # ---- the loader's side ----

    def land(self, layer: int, event: torch.cuda.Event | None = None) -> None:
        """Layer `layer` of every loaded block is in the cache (on CUDA: once `event` is)."""
        self._events[layer] = event
        self._landed[layer].set()

    def fail(self, error: BaseException) -> None:
        """The loads failed: every layer's wait raises from now on."""
        self._error = error
        for landed in self._landed:
            landed.set()

    # ---- the step's side ----

    def wait(self, layer: int) -> None:
        """Before layer `layer` reads its KV: its loads have landed (RuntimeError if they
        failed, or did not land within LOAD_WAIT_S)."""
        if not self._landed[layer].wait(LOAD_WAIT_S):
            raise RuntimeError(f"KV tier loads of layer {layer} did not land within "
                               f"{LOAD_WAIT_S:g} s")
        if self._error is not None:
            raise RuntimeError(f"KV tier loads failed: {self._error}") from self._error
        if self._events[layer] is not None:
            torch.cuda.current_stream().wait_event(self._events[layer])

    def wait_all(self) -> None:
        for layer in range(len(self._landed)):
            self.wait(layer)

    def join(self) -> None:
        """On the host: every layer landed or failed, and on CUDA its copies are done (what
        must hold before a host slot they read is written)."""
        for landed in self._landed:
            landed.wait()
        last = self._events[-1]
        if self._error is None and last is not None:
            last.synchronize()  # the loader's stream runs the layers in order

    def settle(self) -> None:
        """Every layer landed or failed (the step is over: nothing may still write its
        blocks). Never raises for a failed load: the step already did."""
        for layer in range(len(self._landed)):
            if not self._landed[layer].wait(LOAD_WAIT_S):
                logger.error("KV tier loads of layer %d still running after %g s", layer,
                             LOAD_WAIT_S)
            elif self._error is None and self._events[layer] is not None:
                torch.cuda.current_stream().wait_event(self._events[layer])
