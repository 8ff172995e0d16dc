"""rankctl's gRPC API (package ``rankctl.v1``): the generated stubs, and enum names as v1 showed them."""

from __future__ import annotations

import functools
import re
from typing import Any


def short_name(enum: Any, value: int) -> str:
    """An enum value's v1 name, without its type prefix: "RUNNING" for JobState's JOB_STATE_RUNNING.

    ``enum.Name`` gives the prefixed name (declared first; the short ones are its aliases).
    ValueError for a number the enum does not have.
    """
    return enum.Name(value).removeprefix(_prefix(enum.DESCRIPTOR.name))


@functools.cache
def _prefix(enum_name: str) -> str:
    """buf's ENUM_VALUE_PREFIX: the enum's name in upper snake case, "JobState" -> "JOB_STATE_"."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", enum_name).upper() + "_"
