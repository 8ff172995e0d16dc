"""An identity is a name and a role, as a certificate's subject carries them (CN, OU).

Roles in order of power: viewer < submitter < admin (users); ``node`` is a worker daemon and
``coordinator`` the coordinator, outside that order. Pure: no grpc, no cryptography.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rankctl.contract.names import node_name_problem, shown

ROLES = ("viewer", "submitter", "admin")  # user roles, weakest first
NODE = "node"
COORDINATOR = "coordinator"

USER_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
USER_NAME_RULE = "must be 1-63 characters of a-z, 0-9, '.', '_' and '-', starting with a letter or digit"


def user_name_problem(value: object, what: str = "user name") -> str | None:
    if isinstance(value, str) and USER_NAME_RE.fullmatch(value):
        return None
    return f"{what} {shown(value)} {USER_NAME_RULE}"


def identity_problem(name: object, role: object) -> str | None:
    """Why (name, role) is not an identity, or None: the role is known and the name fits its kind."""
    if role == NODE:
        return node_name_problem(name)
    if role == COORDINATOR:
        return None if name == COORDINATOR else f"coordinator name {shown(name)} must be {COORDINATOR!r}"
    if role in ROLES:
        return user_name_problem(name)
    return f"role {shown(role)} must be one of {', '.join((*ROLES, NODE, COORDINATOR))}"


def role_allows(role: str, needed: str) -> bool:
    """Whether a user ``role`` may do what needs ``needed`` (both in ROLES; anything else: False)."""
    if role not in ROLES or needed not in ROLES:
        return False
    return ROLES.index(role) >= ROLES.index(needed)


@dataclass(frozen=True)
class Identity:
    name: str
    role: str

    def __post_init__(self) -> None:
        problem = identity_problem(self.name, self.role)
        if problem:
            raise ValueError(problem)

    @property
    def kind(self) -> str:
        """``node``, ``coordinator`` or ``user``."""
        return self.role if self.role in (NODE, COORDINATOR) else "user"

    def __str__(self) -> str:
        if self.kind == "user":
            return f"user {self.name} ({self.role})"
        return COORDINATOR if self.kind == COORDINATOR else f"{self.kind} {self.name}"
