"""The launcher's warm-ups: each job kind's heavy imports (``JobKind.warm``), done once in the launcher so that
the ranks it forks inherit them (the train and python kinds' ``torch._dynamo``: ~2 s of CPU each rank would
pay). ``Warmth.kinds`` warms the kinds of a launch before it forks; ``Warmth.all`` every registered kind, which
the forker does in its first idle second with no rank alive, so that a spare taking over a lost node's ranks
forks them warm (it was ~2 s of ``bench/recovery.py``'s 3 s)."""

from __future__ import annotations

from typing import Iterable

import structlog

log = structlog.get_logger("rankctl.launcher")


def warm(kind: str) -> None:
    """The kind's heavy imports, before its first ranks fork here (``JobKind.warm``), so its forks inherit them."""
    try:
        from rankctl.runtime.rank import warm_kind

        warm_kind(kind)
    except Exception as exc:  # noqa: BLE001 - a rank reports a broken kind itself; forks stay possible
        log.warning("kind not warmed", kind=kind, error=f"{type(exc).__name__}: {exc}")


class Warmth:
    """The kinds warmed in this launcher."""

    def __init__(self) -> None:
        self.warmed: set[str] = set()

    def kinds(self, kinds: Iterable[str]) -> None:
        for kind in sorted(set(kinds) - self.warmed):
            self.warmed.add(kind)
            warm(kind)

    def all(self) -> None:
        from rankctl.kinds import registry

        self.kinds(registry.kinds())
