"""rankctl's gRPC API (package ``rankctl.v1``): the generated stubs, enum names without their prefix, and
JSON-like values in ``google.protobuf.Struct`` fields."""

from __future__ import annotations

import functools
import re
from typing import Any

from google.protobuf.struct_pb2 import ListValue, Struct, Value


# trailing metadata of a standby's UNAVAILABLE: the leader's address ("" while none leads); ctl and the daemons follow it
LEADER_METADATA = "rankctl-leader"


def short_name(enum: Any, value: int) -> str:
    """An enum value's name without its type prefix: "RUNNING" for JobState's JOB_STATE_RUNNING.

    ValueError for a number the enum does not have.
    """
    return enum.Name(value).removeprefix(_prefix(enum.DESCRIPTOR.name))


def from_short_name(enum: Any, name: str) -> int:
    """The number of a value named without its prefix ("RUNNING" -> JOB_STATE_RUNNING); the prefixed name works
    too. ValueError naming the accepted names for anything else."""
    prefix = _prefix(enum.DESCRIPTOR.name)
    try:
        return enum.Value(name if name.startswith(prefix) else prefix + name)
    except ValueError:
        known = ", ".join(n.removeprefix(prefix) for n in enum.keys() if not n.endswith("_UNSPECIFIED"))
        raise ValueError(f"{name!r} is not a {enum.DESCRIPTOR.name} (one of {known})") from None


@functools.cache
def _prefix(enum_name: str) -> str:
    """buf's ENUM_VALUE_PREFIX: the enum's name in upper snake case, "JobState" -> "JOB_STATE_"."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", enum_name).upper() + "_"


def to_struct(doc: dict[str, Any] | None) -> Struct:
    """A JSON-like dict as a Struct (numbers become doubles; None: an empty Struct)."""
    out = Struct()
    if doc:
        out.update(doc)
    return out


def from_struct(msg: Struct) -> dict[str, Any]:
    """A Struct as plain Python: a whole-valued number comes back as an int (the JSON it was made from)."""
    return {k: _plain(v) for k, v in msg.fields.items()}


def _plain(v: Value) -> Any:
    kind = v.WhichOneof("kind")
    if kind == "number_value":
        n = v.number_value
        return int(n) if n.is_integer() and abs(n) < 2**53 else n
    if kind == "struct_value":
        return from_struct(v.struct_value)
    if kind == "list_value":
        return _plain_list(v.list_value)
    return None if kind in (None, "null_value") else getattr(v, kind)


def _plain_list(msg: ListValue) -> list[Any]:
    return [_plain(v) for v in msg.values]
