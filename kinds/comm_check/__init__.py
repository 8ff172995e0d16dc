"""Job kind ``comm-check``: verify and time every group of the layout (all-reduce, all-gather), like nccl-tests.

Declared here once (``KIND``); ``spec`` (the ``comm_check`` section), ``run`` (the rank's check, torch),
``ops`` (the collectives and their bus factors), ``results`` (the per-kind table), ``render``.
"""

from rankctl.kinds.comm_check.spec import CommCheckSpec
from rankctl.kinds.registry import JobKind

KIND = JobKind(
    name="comm-check",
    sections={"comm_check": CommCheckSpec},
    entry="rankctl.kinds.comm_check.run:run",
    aggregate="rankctl.kinds.comm_check.results:comm_check_result",
    tables="rankctl.kinds.comm_check.render:tables",
)
