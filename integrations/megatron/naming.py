"""Group names that depend on the member list alone (and a purpose), for local synchronization.

torch names a ``use_local_synchronization`` group after its members *and* the number of
groups this process made before, so ranks with different histories disagree on the name
and gloo's rendezvous (keyed by the name) never completes. ``parallel.groups`` solves this
for the main groups; the extra groups made here (gloo copies, one-member groups) share
member lists with those, so they get a salted name of their own.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch.distributed.distributed_c10d as c10d


def salted_name(salt: str, ranks: Iterable[int]) -> str:
    """The name every member computes for the ``salt`` group of ``ranks`` (sorted)."""
    text = f"rankctl_{salt}_" + "_".join(map(str, ranks))
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


@contextmanager
def salted_names(salt: str) -> Iterator[None]:
    """While inside, torch names local-synchronization groups ``salted_name(salt, ranks)``."""
    original = getattr(c10d, "_hash_ranks_to_str", None)
    if original is None:  # a torch without the helper: nothing to patch
        yield
        return
    c10d._hash_ranks_to_str = lambda ranks: salted_name(salt, ranks)
    try:
        yield
    finally:
        c10d._hash_ranks_to_str = original
