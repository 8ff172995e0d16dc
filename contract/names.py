"""Names that become paths, ids and log fields: one rule each, checked with ``fullmatch``.

Job names follow DNS-1123 labels (as Kubernetes object names do); a job id is
``<name>-<6 hex>``; node names follow DNS-1123 subdomains (a lower-cased hostname fits).
None of them can be ``.``/``..``, hold a ``/`` or a control character, so each is safe as
one path component. Errors quote at most a short prefix of the bad value.
"""

from __future__ import annotations

import difflib
import re
import reprlib
from typing import Iterable

JOB_NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
JOB_ID_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?-[0-9a-f]{6}")
NODE_NAME_RE = re.compile(r"(?=.{1,253}\Z)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")

JOB_NAME_RULE = "must be 1-63 characters of a-z, 0-9 and '-', starting and ending with a letter or digit"
JOB_ID_RULE = "must be a job name followed by '-' and 6 hex digits"
NODE_NAME_RULE = ("must be 1-253 characters of a-z, 0-9, '-' and '.', in dot-separated labels of at most 63 "
                  "that start and end with a letter or digit")

SHOWN_PREFIX = 40  # characters of a bad value quoted back in an error

# repr that visits a few items per level and a few levels: bounded work on any value
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, SHOWN_PREFIX, SHOWN_PREFIX, SHOWN_PREFIX
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4


def shown(value: object, limit: int = SHOWN_PREFIX) -> str:
    """``repr`` of at most ``limit`` characters of ``value``, marked when cut."""
    text = value if isinstance(value, str) else _REPR.repr(value)
    cut = text[:limit]
    return repr(cut) + (f"... ({len(text)} characters)" if len(text) > limit else "")


def brief(value: object, limit: int = SHOWN_PREFIX) -> str:
    """``repr`` of ``value`` in about ``limit`` characters without walking all of it (strings as ``shown``)."""
    if isinstance(value, str):
        return shown(value, limit)
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _problem(value: object, regex: re.Pattern[str], what: str, rule: str) -> str | None:
    if isinstance(value, str) and regex.fullmatch(value):
        return None
    return f"{what} {shown(value)} {rule}"


def job_name_problem(value: object, what: str = "job name") -> str | None:
    return _problem(value, JOB_NAME_RE, what, JOB_NAME_RULE)


def job_id_problem(value: object, what: str = "job id") -> str | None:
    return _problem(value, JOB_ID_RE, what, JOB_ID_RULE)


def node_name_problem(value: object, what: str = "node name") -> str | None:
    return _problem(value, NODE_NAME_RE, what, NODE_NAME_RULE)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """" (did you mean NAME?)" for the closest of ``choices`` to a misspelt ``word`` (a job-file field, a ``ctl``
    command); "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
