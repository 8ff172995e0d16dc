"""A small run of ``bench/scale.py`` (64 simulated daemons, the real coordinator, the real protocol).

Guards the benchmark and the batched protocol end to end; it checks counts, never times.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
BENCH = Path(__file__).resolve().parent.parent / "bench" / "scale.py"


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
