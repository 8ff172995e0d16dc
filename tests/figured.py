"""A job kind whose ranks report a training loss (the figures train and python declare) and nothing else runs of:
for in-process coordinator tests of step events, summaries and metrics. ``figured_kind`` registers it for a module."""

from __future__ import annotations

import pytest

from rankctl.kinds import registry
from rankctl.kinds.common import TRAINING_FIGURES
from rankctl.kinds.registry import JobKind

FIGURED = JobKind(name="figured", figures=TRAINING_FIGURES)


@pytest.fixture(autouse=True, scope="module")
def figured_kind():  # noqa: ANN201
    registry.register(FIGURED)
    yield FIGURED
    registry.unregister(FIGURED.name)
