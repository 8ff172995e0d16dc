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
    tls_dir: str | None = None   # the caller's identity directory (mutual TLS); None: plain text

    def client(self) -> "Client":
        from rankctl.cli.client import Client

        return Client(self.coordinator, tls_dir=self.tls_dir)


pass_ctx = click.make_pass_decorator(Ctx)
