"""Megatron-Core on rankctl's process groups (``pip install 'rankctl[megatron]'``).

``process_groups(ctx)`` returns Megatron-Core's ``ProcessGroupCollection`` of one rank's own groups (nothing
global set); ``initialize_model_parallel(ctx)`` fills ``megatron.core.parallel_state`` from them. Importing this
package needs neither torch nor megatron-core; calling it does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .protocol import ParallelContext
from .version import SUPPORTED, MegatronVersionError

if TYPE_CHECKING:
    from .adapter import GroupsContext, build_context
    from .collection import process_groups
    from .init import initialize_model_parallel

__all__ = [
    "GroupsContext",
    "MegatronVersionError",
    "ParallelContext",
    "SUPPORTED",
    "build_context",
    "initialize_model_parallel",
    "process_groups",
]

_LAZY = {"process_groups": ".collection", "initialize_model_parallel": ".init", "GroupsContext": ".adapter",
         "build_context": ".adapter"}


def __getattr__(name: str) -> Any:
    """Import the torch-using parts on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name], __name__), name)
