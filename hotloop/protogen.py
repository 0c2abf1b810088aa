"""Generate the Python gRPC stubs from protos/ into hotloop/proto/.

The stubs are checked in so that a fresh checkout imports without a build step; a test
regenerates them into a temporary directory and fails when the checked-in copy is stale.
Run: `python -m hotloop.protogen` (or `make protos`).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # deferred: only the build needs grpc_tools

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    generated = sorted((out / "hotloop" / "proto").rglob("*.py*"))
    for d in {p.parent for p in generated} | {out / "hotloop" / "proto"}:
        (d / "__init__.py").touch()
    return generated


def main() -> int:
    generate(ROOT)
    print(f"generated stubs under {ROOT / 'hotloop' / 'proto'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
