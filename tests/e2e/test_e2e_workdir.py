"""Shipping ``python.workdir`` end to end on the embedded local cluster (conftest's ``runner``): ``ctl submit``
packs the workdir (honouring ``.rankctlignore``), uploads it once, and every daemon runs the ranks in its
cached, extracted copy; the original may be gone as soon as ``ctl submit`` returns."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from rankctl.cli.client import Client
from rankctl.cli.main import cli

pytestmark = [pytest.mark.timeout(120), pytest.mark.grpc_in_process]
JOB = "name: shipped\nkind: python\nresources: {nodes: 2, slots_per_node: 1}\npython: {entrypoint: train.py}\n"
TRAIN = """import os, helper
assert not os.path.exists("big.dat"), "the ignored big.dat was shipped"
assert not os.path.exists(os.path.join("__pycache__", "stale.pyc")), "the ignored __pycache__ was shipped"
print("cwd", os.getcwd(), helper.VALUE, flush=True)
"""


def make_workdir(root: Path) -> Path:
    root.mkdir()
    (root / "job.yaml").write_text(JOB)
    (root / "train.py").write_text(TRAIN)
    (root / "helper.py").write_text("VALUE = 'helper imported'\n")
    (root / ".rankctlignore").write_text("big.dat\n__pycache__/\n")
    (root / "big.dat").write_bytes(os.urandom(2 << 20))
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "stale.pyc").write_bytes(b"stale")
    return root


def ctl(runner, *args: str):
    return CliRunner().invoke(cli, ["--coordinator", runner.cluster.address, *args], catch_exceptions=False)


def blobs(runner) -> list[str]:
    return sorted(p.name for p in (runner.root / "coordinator" / "blobs").iterdir() if not p.name.startswith("."))


def cwd_lines(runner, job_id: str, ranks: int = 2, timeout: float = 20) -> list[str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with runner.ctx.client() as c:
            lines = [x.line for x in c.logs(job_id, None, False, 50) if x.line.startswith("cwd ")]
        if len(lines) == ranks:
            return lines
        time.sleep(0.2)
    raise AssertionError(f"no cwd lines from every rank of {job_id}: {lines}")


def test_a_shipped_workdir_runs_from_the_nodes_cache_and_is_uploaded_once(runner, tmp_path, monkeypatch) -> None:
    first = make_workdir(tmp_path / "w")
    again = Path(shutil.copytree(first, tmp_path / "copy", symlinks=True))  # the same tree elsewhere
    out = ctl(runner, "submit", str(first / "job.yaml"))
    assert out.exit_code == 0, out.output
    shutil.rmtree(first)  # the cluster never reads the original
    job = runner.wait(re.search(r"^(shipped-\S+)$", out.output, re.M).group(1), timeout=60)
    assert job["state"] == "SUCCEEDED", job["reason"]
    [hexdigest] = blobs(runner)
    for line in cwd_lines(runner, job["id"]):
        cwd = line.split()[1]
        assert re.fullmatch(rf"{re.escape(str(runner.root))}/local-\d/workdirs/{hexdigest}", cwd), line
        assert line.endswith("helper imported")
    done = sorted(runner.root.glob(f"local-*/workdirs/{hexdigest}.done"))
    trees = [p.with_suffix("") for p in done]
    inodes = [p.stat().st_ino for p in trees]  # an extraction renames a new tree into place
    assert len(done) == 2

    def no_upload(*_a, **_k):
        raise AssertionError("the workdir was uploaded again")

    monkeypatch.setattr(Client, "upload_blob", no_upload)  # the same tree: StatBlob says it is stored
    out = ctl(runner, "submit", str(again / "job.yaml"), "--set", "name=shipped-again", "--wait")
    assert out.exit_code == 0, out.output
    assert blobs(runner) == [hexdigest]
    assert [p.stat().st_ino for p in trees] == inodes  # each daemon reused its extracted copy


def test_a_workdir_over_the_cap_is_refused_at_submit(runner, tmp_path) -> None:
    work = make_workdir(tmp_path / "w")
    (work / ".rankctlignore").write_text("")  # big.dat (2 MiB of noise) is packed now
    before = blobs(runner)
    out = ctl(runner, "submit", str(work / "job.yaml"), "--set", "python.workdir_max_mb=1")
    assert out.exit_code == 2
    assert f"python.workdir {work} packs to more than 1 MiB" in out.output
    assert "python.workdir_max_mb=1" in out.output
    assert blobs(runner) == before


def test_a_job_naming_a_blob_the_coordinator_lacks_is_refused(runner) -> None:
    with Client(runner.cluster.address) as c, pytest.raises(Exception, match="upload it first"):
        c.submit(JOB, ["python.workdir_blob=sha256:" + "0" * 64], "test")


def test_an_upload_that_does_not_match_its_digest_is_refused_and_leaves_nothing(runner) -> None:
    from rankctl.cli.errors import CtlError

    before = sorted(p.name for p in (runner.root / "coordinator" / "blobs").iterdir())
    with Client(runner.cluster.address) as c, pytest.raises(CtlError, match="does not match") as err:
        c.upload_blob("sha256:" + "2" * 64, 5, [b"hello"])
    assert err.value.exit_code == 2
    assert sorted(p.name for p in (runner.root / "coordinator" / "blobs").iterdir()) == before


def test_a_workdir_that_cannot_be_fetched_fails_its_ranks_saying_why(runner, tmp_path) -> None:
    from rankctl.cli.workdir import pack_workdir, ship
    from rankctl.kinds.spec import build_spec

    work = make_workdir(tmp_path / "w")
    (work / "train.py").write_text(TRAIN + "# another tree, another digest\n")
    spec = build_spec({"name": "corrupt", "kind": "python", "python": {"entrypoint": "train.py", "workdir": str(work)}})
    with Client(runner.cluster.address) as c:
        [override] = ship(c, pack_workdir(spec))
        digest = override.split("=", 1)[1]
        (runner.root / "coordinator" / "blobs" / digest.removeprefix("sha256:")).write_bytes(b"not the archive")
        job_id = c.submit(JOB, ["name=corrupt", f"python.workdir={work}", override], "test").id
    job = runner.wait(job_id, timeout=60)
    assert job["state"] == "FAILED"
    assert f"refused the assignment: cannot fetch the job's workdir {digest}: workdir blob {digest} arrived with" \
        in job["reason"], job["reason"]
    assert not list(runner.root.glob(f"local-*/workdirs/{digest.removeprefix('sha256:')}*"))


@pytest.fixture(scope="module")
def bomb_blob(runner, tmp_path_factory) -> tuple[str, int]:
    """A 3 MB tar.gz of one 3 GiB file of zeros (written streaming), uploaded: its digest and packed size."""
    import hashlib

    from test_workdir import bomb

    path = bomb(tmp_path_factory.mktemp("bomb") / "bomb.tar.gz", 3 << 30)
    data = path.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with Client(runner.cluster.address) as c:
        c.upload_blob(digest, len(data), [data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)])
    return digest, len(data)


def _bombed(runner, digest: str, *overrides: str) -> dict:
    with Client(runner.cluster.address) as c:
        job_id = c.submit(JOB, ["resources.nodes=1", f"python.workdir_blob={digest}", *overrides], "test").id
    job = runner.wait(job_id, timeout=90)
    assert job["state"] == "FAILED", job["reason"]
    assert f"cannot fetch the job's workdir {digest}: " in job["reason"], job["reason"]
    assert not [p for p in runner.root.glob("local-*/workdirs/*") if p.name != "archive.tar.gz"
                and digest.removeprefix("sha256:")[:12] in p.name]  # what it wrote is gone
    return job


def _stopped_at(reason: str) -> int:
    return int(re.search(r"stopped at (\d+) bytes", reason).group(1))


def test_a_3mb_archive_that_expands_to_3gib_fails_at_the_ratio_having_written_less(runner, bomb_blob) -> None:
    from rankctl.worker.files.blobs import MAX_RATIO

    digest, packed = bomb_blob
    job = _bombed(runner, digest, "name=bomb-ratio")
    assert f"unpacks to more than {MAX_RATIO}x its packed size, a compression bomb" in job["reason"]
    assert _stopped_at(job["reason"]) <= MAX_RATIO * packed + (1 << 20) < 3 << 30


def test_a_bomb_fails_naming_python_workdir_max_unpacked_mb(runner, bomb_blob) -> None:
    digest, _ = bomb_blob
    job = _bombed(runner, digest, "name=bomb-limit", "python.workdir_max_unpacked_mb=12")
    assert "unpacks past python.workdir_max_unpacked_mb=12" in job["reason"], job["reason"]
    assert _stopped_at(job["reason"]) <= 12 << 20
