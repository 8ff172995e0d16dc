"""The coordinator's blob store keeps what jobs need and no more: a per-submitter quota, garbage collection of
blobs no live or recent job references, and a full disk answered as RESOURCE_EXHAUSTED naming the disk (a real
tmpfs under a real coordinator process)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rankctl.coordinator.store.blobs import BlobRefused, BlobStore, referenced
from rankctl.kinds.spec import build_spec

pytestmark = pytest.mark.timeout(120)


async def _one(data: bytes):
    yield data


def put(store: BlobStore, data: bytes, owner: str = "") -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    asyncio.run(store.put(digest, len(data), _one(data), owner))
    return digest


def test_an_upload_past_the_submitters_quota_is_refused_naming_it(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, quota_bytes=10)
    put(store, b"123456", "user alice")
    with pytest.raises(BlobRefused, match=r"submitter user alice would pass the blob quota of 10 bytes: "
                                          r"6 bytes stored, this upload is 5") as err:
        put(store, b"abcde", "user alice")
    assert err.value.full  # RESOURCE_EXHAUSTED
    put(store, b"abcde", "user bob")  # another submitter has a quota of its own
    assert BlobStore(tmp_path, quota_bytes=10).use == {"user alice": 6, "user bob": 5}  # kept across restarts
    assert store.count() == 2


def test_two_uploads_at_once_cannot_both_fit_under_the_quota(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, quota_bytes=10)
    gate = asyncio.Event()

    async def slow(data: bytes):
        await gate.wait()  # both uploads are past their quota check before either writes
        yield data

    async def both() -> list:
        blobs = [b"123456", b"abcdef"]
        tasks = [asyncio.create_task(store.put("sha256:" + hashlib.sha256(b).hexdigest(), 6, slow(b), "user a"))
                 for b in blobs]
        await asyncio.sleep(0.01)
        gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    first, second = asyncio.run(both())
    assert first == 6 and isinstance(second, BlobRefused), (first, second)
    assert store.use == {"user a": 6} and store.count() == 1


def test_the_same_blob_uploaded_twice_at_once_is_charged_once(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, quota_bytes=100)
    data = b"0123456789"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()

    async def both() -> list:
        return await asyncio.gather(store.put(digest, 10, _one(data), "u"), store.put(digest, 10, _one(data), "u"))

    assert asyncio.run(both()) == [10, 10]
    assert store.use == {"u": 10} and store.count() == 1


def test_gc_deletes_only_old_blobs_no_live_or_recent_job_references(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, retention_s=100)
    old, live, recent, fresh = (put(store, bytes([i]) * 3, "u") for i in range(4))
    now = time.time()
    for digest in (old, live, recent):
        os.utime(store.path(digest), (now - 500, now - 500))

    def job(digest: str, finished_at: float) -> SimpleNamespace:
        spec = build_spec({"name": "p", "kind": "python", "python": {"entrypoint": "x.py", "workdir_blob": digest}})
        return SimpleNamespace(spec=spec, finished_at=finished_at)

    jobs = [job(old, now - 200), job(live, 0.0), job(recent, now - 50)]
    refs = referenced(jobs, now, store.retention_s)
    assert refs == {live, recent}
    assert store.collect(refs, now) == [old]
    assert store.size(old) is None and all(store.size(d) == 3 for d in (live, recent, fresh))
    assert store.use == {"u": 9}


@pytest.fixture
def full_disk(tmp_path: Path):
    """A coordinator state dir whose blobs/ is a 1 MiB tmpfs (unmounted at the end)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    blobs = tmp_path / "state" / "blobs"
    blobs.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(blobs)], check=True)
    try:
        yield tmp_path / "state"
    finally:
        subprocess.run(["umount", str(blobs)], check=True)


def test_an_upload_onto_a_full_disk_answers_resource_exhausted_naming_the_disk(full_disk: Path) -> None:
    from rankctl.cli.client import Client
    from rankctl.cli.errors import CtlError
    from tests.cluster import start_coordinator

    proc, address = start_coordinator(full_disk)
    try:
        data = os.urandom(3 << 20)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        with Client(address) as c, pytest.raises(CtlError) as err:
            c.upload_blob(digest, len(data), [data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)])
        assert f"the coordinator's disk under {full_disk / 'blobs'} is full" in str(err.value), str(err.value)
        assert "internal error" not in str(err.value)
        assert os.listdir(full_disk / "blobs") == []  # nothing half-written stays
        with Client(address) as c:
            assert not c.stat_blob(digest)
        assert proc.p.poll() is None  # the coordinator keeps serving
    finally:
        proc.stop()


def test_the_collect_loop_collects_at_start_off_the_loop(tmp_path: Path) -> None:
    from rankctl.coordinator.store.blobs import collect_loop

    store = BlobStore(tmp_path, retention_s=10)
    old, kept = put(store, b"old"), put(store, b"kept")
    os.utime(store.path(old), (1.0, 1.0))
    os.utime(store.path(kept), (1.0, 1.0))
    spec = build_spec({"name": "p", "kind": "python", "python": {"entrypoint": "x.py", "workdir_blob": kept}})
    jobs = [SimpleNamespace(spec=spec, finished_at=0.0)]

    async def main() -> None:
        task = asyncio.create_task(collect_loop(store, lambda: jobs, period_s=3600))
        for _ in range(500):
            if not store.path(old).exists():  # not size(): asking renews a blob's use time
                break
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    assert not store.path(old).exists() and store.size(kept) == 4
