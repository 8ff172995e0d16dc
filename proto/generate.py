"""Generate the protobuf and gRPC stubs (with .pyi) for ``rankctl/v1/rankctl.proto``.

Run ``python -m rankctl.proto.generate`` (needs the dev extra: grpcio-tools, mypy-protobuf).
The stubs are committed; ``tests/unit/proto/test_proto_stubs.py`` fails when they are stale.
Pass ``--out DIR`` to write elsewhere (the freshness test does).

The .proto lives under ``rankctl/v1/`` (its package, as buf's PACKAGE_DIRECTORY_MATCH wants);
the modules stay flat in this package: ``rankctl.proto.rankctl_pb2`` and ``rankctl_pb2_grpc``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("rankctl/v1/rankctl.proto",)
# protoc writes ``from rankctl.v1 import rankctl_pb2 as rankctl_dot_v1_dot_rankctl__pb2`` (the .proto's path)
_ABS_IMPORT = re.compile(r"^from rankctl\.v1 import (\w+_pb2) as (\w+)$", re.M)


def _relativise(path: Path) -> None:
    """The _grpc module imports its _pb2 by the .proto's path; inside this package it is ``from . import``."""
    text = path.read_text()
    path.write_text(_ABS_IMPORT.sub(r"from . import \1 as \2", text))


def _protoc(out: Path) -> None:
    from grpc_tools import protoc  # dev dependency only
    import grpc_tools

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    args = ["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}",
            f"--pyi_out={out}", *[str(HERE / s) for s in SOURCES]]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generate(out: Path) -> list[Path]:
    """Write the stubs of SOURCES flat into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        _protoc(Path(tmp))
        for src in sorted(Path(tmp).rglob("*")):
            if src.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")):
                dst = out / src.name
                dst.write_text(src.read_text())
                written.append(dst)
    for p in written:
        if p.name.endswith("_grpc.py"):
            _relativise(p)
    return sorted(written)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=HERE)
    ns = parser.parse_args(argv)
    for p in generate(ns.out):
        print(p)


if __name__ == "__main__":
    main(sys.argv[1:])
