"""Which megatron-core rankctl.megatron supports, and loading it with a clear error otherwise.

``rankctl.megatron`` writes ``parallel_state``'s private globals, so it is tied to the
versions it was checked against (``tests/integration/test_megatron_conformance.py``); the range here is
the ``rankctl[megatron]`` extra of ``pyproject.toml`` (a test keeps the two equal).
"""

from __future__ import annotations

import importlib.metadata
import re
from types import ModuleType

SUPPORTED = ">=0.16,<0.20,!=0.17.*,!=0.18.*"
MINORS = ((0, 16), (0, 19))   # the minor versions checked: 0.16 on Python 3.11 (CI), 0.19 (Python 3.12+ only)
INSTALL = f"pip install 'rankctl[megatron]'  (or: pip install 'megatron-core{SUPPORTED}')"


class MegatronVersionError(RuntimeError):
    """megatron-core is installed but in a version rankctl.megatron was not checked against."""


def installed_version() -> str | None:
    """The installed megatron-core version string, or None when it is not installed."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def is_supported(version: str) -> bool:
    """True when ``version`` (e.g. ``0.16.1``, ``0.16.0rc2``) lies in ``SUPPORTED``."""
    match = re.match(r"(\d+)\.(\d+)(?!\d)", version)
    return match is not None and (int(match[1]), int(match[2])) in MINORS


def parallel_state() -> ModuleType:
    """``megatron.core.parallel_state``, after checking that a supported version is installed."""
    version = installed_version()
    if version is None:
        raise ImportError(f"rankctl.megatron needs megatron-core {SUPPORTED}, which is not installed: {INSTALL}")
    if not is_supported(version):
        raise MegatronVersionError(
            f"megatron-core {version} is installed, but rankctl.megatron supports megatron-core {SUPPORTED} "
            "(it sets parallel_state's globals and fills ProcessGroupCollection, which change between versions): "
            f"{INSTALL}"
        )
    from megatron.core import parallel_state as ps

    return ps
