"""No dead code in the coordinator (issue 53, item 17): vulture over every product package (so that a use in another
package counts), its findings in ``coordinator/`` checked against the names below. ``rank_from_pb`` and
``JobProgress.lowest_failed`` had no caller (``Coordinator.ranks``, used by tests only, vulture cannot see)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("api", "cli", "contract", "coordinator", "integrations", "kinds", "models", "parallel", "runtime",
           "security", "worker")
CALLED_BY_FRAMEWORKS = {"intercept_service", "PlanJob", "GetJobSchema"}   # grpc calls them by name
# read by tests or metrics only, or written for a reader vulture cannot see: each to be reviewed, none new
KNOWN = {"full_collections", "http_port", "bytes_written", "entries_written", "outstanding", "outranks", "grow",
         "bundles", "schema_version", "journal_mode"}


def test_the_coordinator_has_no_code_nobody_calls() -> None:
    out = subprocess.run([sys.executable, "-m", "vulture", *PRODUCT, "--min-confidence", "60"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 3), out.stderr       # 3: found some
    found = re.findall(r"^(coordinator/\S+): unused \w+ '(\w+)'", out.stdout, re.M)
    unknown = [(where, name) for where, name in found if name not in CALLED_BY_FRAMEWORKS | KNOWN]
    assert unknown == [], unknown
