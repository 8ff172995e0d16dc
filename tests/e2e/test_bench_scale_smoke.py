"""Small runs of ``bench/scale.py`` (simulated daemons, the real coordinator, the real protocol).

64 daemons guard the benchmark and the batched protocol end to end (counts, never times); a ``--fault`` run of
4 and 8 daemons guards the recovery bench: a killed node, a restart on a spare, every figure measured (that each
exists, is positive and in order; never how large).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale.py"


def test_64_simulated_nodes_store_every_step_and_none_is_lost() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--nodes", "64", "--slots", "8", "--steps", "3"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    final = out.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in final.split()[1:])
    assert fields["nodes"] == "64" and fields["ranks"] == "512" and fields["mode"] == "batched", final
    assert fields["steps_stored"] == "3/3" and fields["lost"] == "0", final
    assert re.search(r"job\s*:\s*SUCCEEDED \(all 512 ranks exited 0\)", out.stdout), out.stdout[-2000:]
    assert float(fields["assign_s"]) >= 0 and float(fields["cpu_us_per_rank_step"]) > 0, final


def test_a_killed_simulated_node_restarts_the_job_on_a_spare_and_every_recovery_figure_is_measured() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--fault", "--nodes", "8", "--small-nodes", "4", "--slots", "2",
                          "--spares", "2", "--faults", "2", "--step-rate", "4", "--recovery-timeout", "30"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("fault nodes=")]
    assert len(lines) == 2, out.stdout[-3000:]
    for line, nodes in zip(lines, ("4", "8")):
        fields = dict(kv.split("=", 1) for kv in line.split()[1:])
        assert fields["nodes"] == nodes and fields["lost"] == "2", line   # two nodes killed one after the other
        assert int(fields["attempt"]) == 3 and int(fields["step"]) >= 1, line
        for key in ("a_s", "b_s", "c_s", "coord_b_s", "coord_c_s"):
            assert float(fields[key]) > 0, (key, line)  # nan (never measured) fails too
        assert float(fields["a_s"]) <= float(fields["b_s"]) <= float(fields["c_s"]), line
    # the simulated daemons stop an older attempt before a newer Assign, as the daemon does: restarts go in place
    assert "4 nodes in place (no Cancel, no stop confirmed), 8 nodes in place" in out.stdout, out.stdout[-2000:]
    assert re.search(r"^\(c\) first step of the next attempt stored\s+[\d.]+\s+[\d.]+\s+[\d.]+x$", out.stdout, re.M), \
        out.stdout[-2000:]
    each = re.findall(r"^coordinator's share of \(c\) at \d+ ranks, each fault: ([\d.]+), ([\d.]+)$", out.stdout, re.M)
    assert len(each) == 2, out.stdout[-2000:]   # both recoveries of both sizes measured (the table has their medians)
