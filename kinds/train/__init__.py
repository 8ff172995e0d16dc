"""Job kind ``train``: a sharded GPT trained over any tp/sp/cp/ep/pp/dp layout.

Declared here once (``KIND``); the modules: ``spec`` (``model``, ``train`` sections), ``checks``
(cross-field rules), ``data`` (token data, numpy), ``loop`` (the rank's training loop), ``optim``,
``checkpoint``, ``train_state`` (torch), ``render`` (``ctl``'s view); the job's losses, their figures and
tables, and the optimiser warm-up are ``kinds.common``'s, shared with ``python``.
"""

from rankctl.contract.files.rankfiles import SAVED_ON_REQUEST
from rankctl.kinds.common import TRAINING_FIGURES
from rankctl.kinds.registry import JobKind
from rankctl.kinds.train.spec import ModelSpec, TrainSpec

KIND = JobKind(
    name="train",
    sections={"model": ModelSpec, "train": TrainSpec},
    check="rankctl.kinds.train.checks:errors",
    entry="rankctl.kinds.train.loop:run",
    aggregate="rankctl.kinds.common:losses_result",
    summary="rankctl.kinds.common:losses_summary",
    tables="rankctl.kinds.train.render:tables",
    progress="rankctl.kinds.train.render:progress",
    client_overrides="rankctl.kinds.train.checks:absolute_data",
    node_paths="rankctl.kinds.train.checks:node_paths",
    written_paths="rankctl.kinds.train.checks:written_paths",
    drain_checkpoint=True,
    figures={**TRAINING_FIGURES, SAVED_ON_REQUEST: "max"},   # every rank saved it: coordinator.drains waits
    warm="rankctl.kinds.common:warm",
)
