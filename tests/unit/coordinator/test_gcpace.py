"""The coordinator's collector pacing (``coordinator.app.gcpace``), pure: survivors frozen every FREEZE_S, and
everything collected (frozen cycles too) every FULL_S."""

from __future__ import annotations

import gc
import weakref

from rankctl.coordinator.app.gcpace import FREEZE_S, FULL_S, Freezer


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_survivors_are_frozen_and_frozen_cycles_are_collected_once_a_full_period() -> None:
    gc.unfreeze()   # what an earlier test in this process froze
    gc.collect()
    try:
        f = Freezer(0.0)
        f.turn(FREEZE_S - 1)
        assert gc.get_freeze_count() == 0
        garbage = weakref.ref(Cycle())   # garbage at once, but a cycle: only the collector frees it
        f.turn(FREEZE_S)
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert garbage() is not None     # frozen: out of the collector's sight
        f.turn(FULL_S)
        assert garbage() is None and f.full_collections == 1 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
