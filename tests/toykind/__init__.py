"""A job kind that lives in this folder only: registered by importing it (``KIND``).

It proves the plug-in interface: its spec section, check, rank entry, aggregation and
rendering are declared here, and nothing outside this folder names it.
"""

from pydantic import StrictInt

from rankctl.contract.spec import Section
from rankctl.kinds.registry import JobKind


class ToySpec(Section):
    value: StrictInt = 1


def check(spec, cfg) -> list[str]:
    return [] if spec.toy.value >= 0 else [f"toy.value={spec.toy.value} must not be negative"]


KIND = JobKind(
    name="toy-kind",
    sections={"toy": ToySpec},
    check=check,
    entry="toykind.rank:run",
    aggregate="toykind.results:total",
    summary="toykind.results:summary",
)
