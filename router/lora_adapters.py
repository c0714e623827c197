"""LoRAAdapters: the LoRA adapters a router serves over the base model, by name.

A client picks one by the request's `model` (OpenAI and gRPC alike), as with vLLM's
`--lora-modules`. Adapters are given at start (`--lora-modules name=path ...`) or loaded and
unloaded at run time (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`); each is checked
against the base model before it is listed (`engine.lora_adapter.check_adapter`: its files,
rank, modules and shapes), so a bad adapter is refused here and no worker ever holds it.

Each load gets a new `lora_int_id`: the workers and the prefix cache tell an adapter loaded
anew under an old name from the old one. Router processes of one deployment share the table
through Redis (`Router.load_lora`, `Router.sync_loras`): a load or unload on any of them
reaches the others within a health refresh (about a second). No torch here.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterator, Mapping

from pdserve.engine.config import ModelConfig
from pdserve.engine.lora_adapter import check_adapter
from pdserve.engine.lora_request import LoRARequest

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def parse_lora_modules(text: str | None) -> dict[str, str]:
    """`--lora-modules`: `name=path` entries separated by spaces or commas, or a JSON object
    {name: path} (a YAML mapping); ValueError naming the bad entry."""
    if not text:
        return {}
    if text.lstrip().startswith("{"):
        try:
            modules = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"lora_modules: not a JSON object: {exc}") from None
        if not all(isinstance(v, str) for v in modules.values()):
            raise ValueError("lora_modules: each adapter's value is its path (a string)")
        return dict(modules)
    modules = {}
    for entry in re.split(r"[\s,]+", text.strip()):
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: {entry!r} is not name=path")
        modules[name] = path
    return modules


class LoRAAdapters:
    def __init__(self, model: ModelConfig, base_name: str, max_lora_rank: int,
                 modules: Mapping[str, str] = ()) -> None:
        """The adapters of `modules` (name -> PEFT directory), each checked (ValueError naming
        the first bad one) and numbered 1, 2, ... in order (every router process alike)."""
        self.model, self.base_name, self.max_lora_rank = model, base_name, max_lora_rank
        self._adapters: dict[str, LoRARequest] = {}
        self._lock = threading.Lock()  # checks run off the event loop (they read files)
        for i, (name, path) in enumerate(dict(modules).items(), 1):
            self.add(self.check(name, path, i))

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(list(self._adapters.values()))

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name) if isinstance(name, str) else None

    def check(self, name: str, path: str, lora_int_id: int | None = None) -> LoRARequest:
        """The adapter at `path` as `name`, checked against the base model and numbered (by
        default anew: microseconds since the epoch); ValueError naming the field at fault."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"lora_name must be 1-128 letters, digits or ._:/- (starting with "
                             f"a letter or digit), got {name!r}")
        if name == self.base_name or name in self._adapters:
            raise ValueError(f"lora_name: {name!r} is already served; unload it first")
        if not isinstance(path, str) or not path:
            raise ValueError(f"lora_path must be a directory path, got {path!r}")
        check_adapter(path, self.model, self.max_lora_rank)
        return LoRARequest(name, lora_int_id or time.time_ns() // 1000, path)

    def add(self, lora: LoRARequest) -> None:
        """Serve `lora` (checked); ValueError if another adapter has its name."""
        with self._lock:
            held = self._adapters.setdefault(lora.lora_name, lora)
        if held != lora:
            raise ValueError(f"lora_name: {lora.lora_name!r} is already served; unload it first")
        logger.info("LoRA adapter %s (id %d) served from %s", lora.lora_name, lora.lora_int_id,
                    lora.lora_path)

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving `name` (requests in flight with it finish); what it was, if served."""
        with self._lock:
            lora = self._adapters.pop(name, None)
        if lora is not None:
            logger.info("LoRA adapter %s no longer served", name)
        return lora

    def sync(self, table: Mapping[str, LoRARequest]) -> None:
        """Serve exactly `table`: the adapters every router process shares (Redis)."""
        for name in [n for n, lora in self._adapters.items() if table.get(n) != lora]:
            self.remove(name)
        for lora in table.values():
            if lora.lora_name not in self._adapters and lora.lora_name != self.base_name:
                self.add(lora)
