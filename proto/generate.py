"""Generate the protobuf and gRPC stubs (with .pyi) for ``rankctl.proto``.

Run ``python -m rankctl.proto.generate`` (needs the dev extra: grpcio-tools, mypy-protobuf).
The stubs are committed; ``tests/test_proto_stubs.py`` fails when they are stale.
Pass ``--out DIR`` to write elsewhere (the freshness test does).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("rankctl.proto",)
_ABS_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.M)


def _relativise(path: Path) -> None:
    """protoc writes ``import rankctl_pb2``; inside a package it must be ``from . import``."""
    text = path.read_text()
    path.write_text(_ABS_IMPORT.sub(r"from . import \1 as \2", text))


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency only
    import grpc_tools

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{HERE}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *[str(HERE / s) for s in SOURCES],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = sorted(p for p in out.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))
    for p in written:
        if p.name.endswith("_grpc.py"):
            _relativise(p)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=HERE)
    ns = parser.parse_args(argv)
    for p in generate(ns.out):
        print(p)


if __name__ == "__main__":
    main(sys.argv[1:])
