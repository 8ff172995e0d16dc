"""A job kind that lives in this folder only: registered by importing it (``KIND``).

It proves the plug-in interface: its spec section, check, rank entry, aggregation and
rendering are declared here, and so are its capabilities: the node file it reads (sandboxed by
the worker) and a checkpoint on request (a node's drain waits for it). Nothing outside this
folder names it.
"""

from pydantic import StrictInt, StrictStr

from rankctl.contract.files.rankfiles import SAVED_ON_REQUEST
from rankctl.contract.spec import Section
from rankctl.kinds.registry import JobKind


class ToySpec(Section):
    value: StrictInt = 1
    steps: StrictInt = 0       # > 0: report that many steps, saving a checkpoint when the daemon asks
    path: StrictStr = ""       # a node file every rank reads: the worker keeps it under its roots


def check(spec, cfg) -> list[str]:
    return [] if spec.toy.value >= 0 else [f"toy.value={spec.toy.value} must not be negative"]


def node_paths(spec, workdir: str, cwd: str) -> list:
    return [("toy.path", spec.toy.path, spec.toy.path)] if spec.toy.path else []


KIND = JobKind(
    name="toy-kind",
    sections={"toy": ToySpec},
    check=check,
    entry="toykind.rank:run",
    aggregate="toykind.results:total",
    summary="toykind.results:summary",
    node_paths=node_paths,
    drain_checkpoint=True,
    figures={SAVED_ON_REQUEST: "max"},   # the step every rank saved on request: a drain moves the job once it is complete
)
