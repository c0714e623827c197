"""Run a kernel on another device while the test keeps its CPU tensors (the kernel tests' GPU
mode, `PDSERVE_KERNEL_DEVICE=cuda`).

The kernel tests build their cases on the CPU and compare with the torch references there.
In GPU mode every Triton entry point a test module imported is swapped for `shuttled(fn,
device)`, so every existing case and tolerance runs unchanged against the compiled kernels:

- each distinct storage the arguments view (inside lists, tuples, dicts and data classes too) is
  copied once to the device and every argument is rebuilt as the same view of the copy, so
  strides, offsets and aliasing (a cache and its views, an in-place output) are kept;
- after the call every copied storage is written back to the original: an in-place kernel's
  writes land in the test's own tensors;
- a returned tensor that views a copied storage becomes the same view of the original; any
  other tensor comes back as a CPU copy; a returned object (a prepared kernel holding device
  weights, a callable data class too) comes back shuttled, so calling it later goes through the
  same copies.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

HOST = torch.device("cpu")


class Shuttled:
    """An object living on the device; calls (and calls of its methods) are shuttled."""

    def __init__(self, target: Any, device: torch.device) -> None:
        self._target, self._device = target, device

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance() sees the target's class
        return type(self._target)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return shuttled(self._target, self._device)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        return shuttled(value, self._device) if callable(value) else value


class _Copies:
    """The storages of one call: original -> device copy, found again by data pointer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.to_device: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self.to_host: dict[int, torch.UntypedStorage] = {}

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":  # shapes only (argument checks): nothing to copy
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.to_device:
            copy = torch.UntypedStorage(storage.nbytes(), device=self.device)
            copy.copy_(storage)
            self.to_device[key] = (storage, copy)
            self.to_host[copy.data_ptr()] = storage
        return _view(self.to_device[key][1], t, self.device)

    def write_back(self) -> None:
        for original, copy in self.to_device.values():
            original.copy_(copy)

    def result(self, t: torch.Tensor) -> torch.Tensor:
        original = self.to_host.get(t.untyped_storage().data_ptr())
        return t.to(HOST) if original is None else _view(original, t, HOST)


def _view(storage: torch.UntypedStorage, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty(0, dtype=like.dtype, device=device)
    return out.set_(storage, like.storage_offset(), like.shape, like.stride())


def _map(obj: Any, tensor: Callable[[torch.Tensor], torch.Tensor],
         other: Callable[[Any], Any]) -> Any:
    """`obj` with every tensor inside it replaced, and other leaves given to `other`."""
    if isinstance(obj, torch.Tensor):
        return tensor(obj)
    if isinstance(obj, (list, tuple)):
        items = [_map(x, tensor, other) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: _map(v, tensor, other) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not callable(obj):
        fields = {f.name: _map(getattr(obj, f.name), tensor, other)
                  for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **fields)
    return other(obj)


def _unwrap(obj: Any) -> Any:
    return obj._target if isinstance(obj, Shuttled) else obj


def _returned(device: torch.device) -> Callable[[Any], Any]:
    def wrap(obj: Any) -> Any:
        plain = obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.dtype,
                                                torch.device))
        return obj if plain or isinstance(obj, Shuttled) else Shuttled(obj, device)
    return wrap


def shuttled(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """`fn` run on `device` for arguments and results on the host (see the module doc)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        copies = _Copies(device)
        args, kwargs = _map((args, kwargs), copies.tensor, _unwrap)
        out = fn(*args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        copies.write_back()
        return _map(out, copies.result, _returned(device))

    return call
