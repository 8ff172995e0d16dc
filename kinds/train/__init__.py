"""Job kind ``train``: a sharded GPT trained over any tp/sp/cp/ep/pp/dp layout.

Declared here once (``KIND``); the modules: ``spec`` (``model``, ``train`` sections), ``checks``
(cross-field rules), ``data`` (token data, numpy), ``loop`` (the rank's training loop), ``optim``,
``checkpoint``, ``train_state`` (torch), ``results`` (the job result), ``render`` (``ctl``'s view).
"""

from rankctl.kinds.registry import JobKind
from rankctl.kinds.train.spec import ModelSpec, TrainSpec

KIND = JobKind(
    name="train",
    sections={"model": ModelSpec, "train": TrainSpec},
    check="rankctl.kinds.train.checks:errors",
    entry="rankctl.kinds.train.loop:run",
    aggregate="rankctl.kinds.train.results:train_result",
    summary="rankctl.kinds.train.render:summary",
    tables="rankctl.kinds.train.render:tables",
    progress="rankctl.kinds.train.render:progress",
    client_overrides="rankctl.kinds.train.checks:absolute_data",
    node_paths="rankctl.kinds.train.checks:node_paths",
    drain_checkpoint=True,
    warm="rankctl.kinds.train.optim:warm",
)
