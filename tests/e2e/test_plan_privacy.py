"""Checking a job tells nothing about the files of the checker's host: ``train.data`` is checked by its text
at submit (coordinator and ``ctl``), and only on the node, inside its sandbox, for existence and size."""

from __future__ import annotations

import asyncio
import builtins
import json
import os
from pathlib import Path

import grpc
import pytest
from google.protobuf.json_format import MessageToDict

from rankctl.coordinator.app.server import start_coordinator
from rankctl.kinds.spec import build_spec, check_job
from rankctl.kinds.train.data import data_problem
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc

pytestmark = pytest.mark.grpc_in_process
SIZE = 12_347  # an odd size no answer may quote
JOB = "name: t\nkind: train\nmodel: {{heads: {heads}}}\ntrain: {{data: '{data}'}}\n"


@pytest.fixture
def data_paths(tmp_path: Path) -> dict[str, str]:
    """The kinds of path whose answers used to differ: missing, a file, an odd token file, empty, a directory."""
    (tmp_path / "corpus.txt").write_bytes(b"x" * SIZE)
    (tmp_path / "odd.bin").write_bytes(b"x" * SIZE)
    (tmp_path / "empty.txt").write_bytes(b"")
    return {name: str(tmp_path / name) for name in ("missing.txt", "corpus.txt", "odd.bin", "empty.txt")} | {
        "dir": str(tmp_path), "shadow": "/etc/shadow"}


def test_the_data_check_reads_its_text_only(data_paths, monkeypatch) -> None:
    def spy(real):
        def call(*args, **kwargs):
            if any(isinstance(a, (str, bytes, os.PathLike)) and os.fsdecode(a).startswith(
                    tuple(data_paths.values())) for a in args):
                raise AssertionError(f"the check touched {args[0]!r}")
            return real(*args, **kwargs)
        return call

    for name in ("stat", "lstat", "access", "open", "listdir", "scandir"):
        monkeypatch.setattr(os, name, spy(getattr(os, name)))
    monkeypatch.setattr(builtins, "open", spy(builtins.open))
    for path in data_paths.values():
        check_job(build_spec({"name": "t", "kind": "train", "train": {"data": path}}))


def test_only_the_text_of_train_data_can_be_refused() -> None:
    assert data_problem("builtin:pydoc") is None and data_problem("relative/corpus.txt") is None
    assert "unknown builtin data set" in data_problem("builtin:shakespeare")
    assert data_problem("") == "train.data is empty: give 'builtin:pydoc' or the path of a text or uint16 token file"
    assert "NUL" in data_problem("/a\x00b")
    assert "longer than the 4096 characters" in data_problem("/" + "a" * 5000)


def run(test, state_dir: Path):  # noqa: ANN001, ANN201 - (client stub) -> awaitable
    async def main():  # noqa: ANN202
        coord = await start_coordinator("127.0.0.1:0", state_dir, heartbeat_timeout=10.0)
        try:
            async with grpc.aio.insecure_channel(coord.address) as channel:
                return await asyncio.wait_for(test(rankctl_pb2_grpc.ClientServiceStub(channel)), 20)
        finally:
            await coord.stop(grace=0.1)
    return asyncio.run(main())


async def _answer(call, request, path: str) -> str:  # noqa: ANN001
    """The RPC's answer (or its error) as text with ``path``, the job id and the times taken out."""
    try:
        reply = MessageToDict(await call(request))
    except grpc.aio.AioRpcError as exc:
        reply = {"code": exc.code().name, "details": exc.details()}
    job = reply.get("job", {})
    for volatile in ("id", "createTime"):
        job.pop(volatile, None)
    return json.dumps(reply, sort_keys=True).replace(json.dumps(path)[1:-1], "<DATA>")


@pytest.mark.parametrize("heads", [4, 3])  # a job that plans, and one refused for another field
def test_plan_and_submit_answer_the_same_whatever_the_files(tmp_path: Path, data_paths, heads: int) -> None:
    async def test(client: rankctl_pb2_grpc.ClientServiceStub) -> dict[str, list[str]]:
        out = {}
        for name, path in data_paths.items():
            text = JOB.format(heads=heads, data=path)
            out[name] = [await _answer(client.PlanJob, pb.PlanJobRequest(spec_yaml=text), path),
                         await _answer(client.SubmitJob, pb.SubmitJobRequest(spec_yaml=text, queue_anyway=True), path)]
        return out

    answers = run(test, tmp_path / "coord")
    assert len({json.dumps(a) for a in answers.values()}) == 1, answers
    plan, submit = answers["missing.txt"]
    assert str(SIZE) not in plan + submit and "bytes" not in plan + submit and "no such file" not in plan + submit
    if heads == 4:
        assert '"layout"' in plan and '"state": "JOB_STATE_PENDING"' in submit
    else:
        assert "INVALID_ARGUMENT" in plan and "model.heads=3" in submit
