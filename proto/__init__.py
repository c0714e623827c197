"""Protocol buffers of pdserve: the public API (pdserve.proto), the worker control plane
(worker.proto) and the router's UTF-8 fallback (raw.proto).

The Python stubs are generated from the .proto files on first import (and again whenever a
.proto is newer than its stub), under a file lock so that processes starting together do not
race. Import them from here: `from proto import pdserve_pb2, pdserve_pb2_grpc`.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PROTOS = ("pdserve", "worker", "raw")


def _stale(name: str) -> bool:
    source = _HERE / f"{name}.proto"
    stubs = [_HERE / f"{name}_pb2.py", _HERE / f"{name}_pb2_grpc.py"]
    return any(not s.exists() or s.stat().st_mtime < source.stat().st_mtime for s in stubs)


def _generate() -> None:
    from grpc_tools import protoc

    with open(_HERE / ".generate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stale = [name for name in _PROTOS if _stale(name)]
        if not stale:
            return
        root = _HERE.parent  # stubs import each other as `proto.<name>_pb2`
        args = ["grpc_tools.protoc", f"-I{root}", f"--python_out={root}",
                f"--grpc_python_out={root}"]
        code = protoc.main(args + [f"proto/{name}.proto" for name in stale])
        if code != 0:
            raise RuntimeError(f"protoc failed ({code}) on {stale} in {_HERE}")


if any(_stale(name) for name in _PROTOS):
    _generate()

from proto import (  # noqa: E402
    pdserve_pb2,
    pdserve_pb2_grpc,
    raw_pb2,
    worker_pb2,
    worker_pb2_grpc,
)

__all__ = ["pdserve_pb2", "pdserve_pb2_grpc", "raw_pb2", "worker_pb2", "worker_pb2_grpc"]
