"""The context object every ``ctl`` command receives (``pass_ctx``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from rankctl.cli.client import Client


class Ctx:
    """What the global options gave (flag or env; None: not given) and the named context; the coordinator
    address and the TLS directory are resolved from those and the config file when first read."""

    def __init__(self, coordinator: str | None = None, tls_dir: str | None = None, context: str | None = None) -> None:
        self._given = (coordinator or None, tls_dir or None)
        self.context = context or None
        self._resolved: tuple[str, str | None] | None = None

    def _resolve(self) -> tuple[str, str | None]:
        if self._resolved is None:
            from rankctl.cli.contexts import resolve

            self._resolved = resolve(*self._given, self.context)
        return self._resolved

    @property
    def coordinator(self) -> str:
        return self._resolve()[0]

    @property
    def tls_dir(self) -> str | None:
        """The caller's identity directory (mutual TLS); None: plain text."""
        return self._resolve()[1]

    def client(self) -> "Client":
        from rankctl.cli.client import Client

        return Client(self.coordinator, tls_dir=self.tls_dir)


pass_ctx = click.make_pass_decorator(Ctx)
