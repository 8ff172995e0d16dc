"""The one reader of /proc/meminfo (``worker.files.meminfo``): the launcher's hardware facts, the daemon's usage
and the snapshot memory's default bound all read it here."""

from __future__ import annotations

from pathlib import Path

from rankctl.worker.files.meminfo import meminfo, total_bytes


def test_it_reads_the_keys_asked_for_in_bytes_and_nothing_from_a_missing_or_garbled_file(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    8000 kB\n")
    assert meminfo(path) == {"MemTotal": 16384000 * 1024, "MemAvailable": 8000 * 1024}
    assert total_bytes(path) == 16384000 * 1024
    assert meminfo(tmp_path / "missing") == {} and total_bytes(tmp_path / "missing") == 0
    path.write_text("MemTotal: lots\n")
    assert meminfo(path) == {} and total_bytes(path) == 0
    assert total_bytes() > 0    # this machine's
