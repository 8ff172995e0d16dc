"""The cyclic collector in a coordinator process, kept off the critical path.

``tune_gc`` (at start) moves what is loaded out of the collector's sight. What comes later - a fleet's
sessions after a registration storm, an attempt's rank records - would otherwise sit in the young
generations until a collection traverses it all at once, wherever an allocation happens to trip it: measured
at 8,192 nodes, a 680 ms collection inside the first restart's apply of its start-up reports (the same apply
took 0.12 s in the next restart). ``Freezer.turn`` (the monitor's, every tick) moves the survivors of the
last ``FREEZE_S`` out of sight too (``gc.freeze`` is constant time); the records are acyclic and go by
reference counting when replaced. Cyclic garbage frozen meanwhile is collected once every ``FULL_S``
(``gc.unfreeze``, a full collection, ``gc.freeze``): one bounded pause an hour instead of unbounded ones
at random.
"""

from __future__ import annotations

import gc

FREEZE_S = 10.0      # survivors of this long leave the collector's sight
FULL_S = 3600.0      # a full collection of everything, frozen included, this often


class Freezer:
    """``freeze_s``: how long survivors stay in sight (``bench/scale_sim.py``'s processes, each thousands of
    simulated daemons, freeze every second)."""

    def __init__(self, now: float, freeze_s: float = FREEZE_S) -> None:
        self._frozen_at = self._full_at = now
        self._freeze_s = freeze_s
        self.full_collections = 0

    def turn(self, now: float) -> None:
        if now - self._full_at >= FULL_S:
            self._full_at = self._frozen_at = now
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            self.full_collections += 1
        elif now - self._frozen_at >= self._freeze_s:
            self._frozen_at = now
            gc.freeze()
