"""Regenerate the committed gRPC stubs in proto/ from the .proto files beside them.

    .venv/bin/python scripts/gen_proto.py            # after editing a .proto
    .venv/bin/python scripts/gen_proto.py --check    # exit 1 if a stub is stale (tests run it)

The stubs are committed so that wheels and editable installs alike carry them and nothing is
generated at run time. protoc sees the files as `pdserve/proto/<name>.proto`, so the stubs
import each other as `pdserve.proto.<name>_pb2` — inside pdserve's one namespace.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[1] / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Write every stub into `out_dir`; returns their paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "pdserve" / "proto"
        package.mkdir(parents=True)
        sources = sorted(PROTO_DIR.glob("*.proto"))
        for source in sources:
            shutil.copy(source, package / source.name)
        args = ["grpc_tools.protoc", f"-I{tmp}", f"--python_out={tmp}", f"--grpc_python_out={tmp}"]
        code = protoc.main(args + [f"pdserve/proto/{s.name}" for s in sources])
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        stubs = sorted(p for p in package.glob("*_pb2*.py"))
        out_dir.mkdir(parents=True, exist_ok=True)
        for stub in stubs:
            shutil.copy(stub, out_dir / stub.name)
        return [out_dir / stub.name for stub in stubs]


def stale_stubs() -> list[str]:
    """Names of committed stubs that differ from what the .proto files generate now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = {p.name for p in PROTO_DIR.glob("*_pb2*.py")}
        stale = [p.name for p in fresh
                 if p.name not in committed or p.read_bytes() != (PROTO_DIR / p.name).read_bytes()]
        return stale + sorted(committed - {p.name for p in fresh})


def main() -> int:
    if sys.argv[1:] == ["--check"]:
        stale = stale_stubs()
        if stale:
            print(f"stale stubs: {stale}; run python scripts/gen_proto.py", file=sys.stderr)
        return 1 if stale else 0
    for path in generate(PROTO_DIR):
        print(path.relative_to(PROTO_DIR.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
