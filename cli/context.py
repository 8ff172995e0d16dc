"""The context object every ``ctl`` command receives (``pass_ctx``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from rankctl.cli.client import Client


@dataclass
class Ctx:
    coordinator: str

    def client(self) -> "Client":
        from rankctl.cli.client import Client

        return Client(self.coordinator)


pass_ctx = click.make_pass_decorator(Ctx)
