"""Job kind ``python``: the user's own training code, run in every rank as torchrun would run it.

Declared here once (``KIND``); ``spec`` (the ``python`` section), ``checks`` (entry-point form, ``ctl``'s
absolute workdir, the packed workdir's blob), ``run`` (the rank's entry: torchrun's environment, then the script or function),
``results``/``render`` (the losses and metrics ``rankctl.context().report`` wrote, shown as ``train`` shows them, through ``kinds.common``).
"""

from rankctl.kinds.common import TRAINING_FIGURES
from rankctl.kinds.python.spec import PythonSpec
from rankctl.kinds.registry import JobKind

KIND = JobKind(
    name="python",
    sections={"python": PythonSpec},
    check="rankctl.kinds.python.checks:errors",
    entry="rankctl.kinds.python.run:run",
    aggregate="rankctl.kinds.python.results:python_result",
    summary="rankctl.kinds.python.render:summary",
    tables="rankctl.kinds.common:loss_tables",
    progress="rankctl.kinds.python.render:progress",
    client_overrides="rankctl.kinds.python.checks:absolute_workdir",
    blobs="rankctl.kinds.python.checks:blobs",
    blob_limit="rankctl.kinds.python.checks:unpacked_limit",
    shipment="rankctl.kinds.python.checks:shipment",
    node_paths="rankctl.kinds.python.checks:node_paths",
    own_rendezvous=True,
    secrets=("python.env",),   # its values reach the ranks only, never a client
    figures=TRAINING_FIGURES,  # what ctx.report(step, loss, ...) reports
    warm="rankctl.kinds.common:warm",  # users' scripts build torch optimisers too
)
