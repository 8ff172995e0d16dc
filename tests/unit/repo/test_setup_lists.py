"""README's set-up is what CI runs (issue 53, item 20): its apt-get line is the one list of Debian packages the tests
need; ``.ci/run`` reads it from there and knows the command each one brings."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def readme_packages() -> list[str]:
    line = re.search(r"^apt-get install -y --no-install-recommends ([^#\n]*)#", (ROOT / "README.md").read_text(), re.M)
    assert line, "README.md has no apt-get install line"
    return line.group(1).split()


def test_readme_lists_every_package_the_tests_use_and_ci_reads_that_list() -> None:
    packages = readme_packages()
    assert "kubernetes-client" in packages, packages      # kubectl: the Kubernetes manifest test
    ci = (ROOT / ".ci" / "run").read_text()
    assert "README.md" in ci and "sed -n" in ci, "CI reads README's apt-get line"
    known = set(re.findall(r"\[([\w-]+)\]=", ci))
    assert set(packages) == known, (sorted(set(packages) - known), sorted(known - set(packages)))
