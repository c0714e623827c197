"""pdserve: disaggregated prefill/decode LLM serving. Offline API: LLM, SamplingParams."""

from __future__ import annotations

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from pdserve.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
