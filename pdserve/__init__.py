"""pdserve: disaggregated prefill/decode LLM serving.

Offline: `LLM`, `SamplingParams` (`StructuredOutputsParams` for a grammar), `LoRARequest`. Online
(gRPC): `Client`, `AsyncClient`. Attributes load on first use, so the router and the
client never import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "pdserve.llm",
    "RequestOutput": "pdserve.engine.outputs",
    "Logprob": "pdserve.engine.outputs",
    "SamplingParams": "pdserve.engine.sampling_params",
    "StructuredOutputsParams": "pdserve.engine.structured_outputs_params",
    "LoRARequest": "pdserve.engine.lora_request",
    "Client": "pdserve.client",
    "AsyncClient": "pdserve.client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
