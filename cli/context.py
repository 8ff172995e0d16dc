"""The context object every ``ctl`` command receives (``pass_ctx``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from rankctl.cli.client import Client


class Ctx:
    """The coordinator to talk to and the TLS directory to do it with.

    ``Ctx(coordinator=ADDR)`` means exactly that (the default address, plain text, when not given).
    ``Ctx.from_options`` (the ``ctl`` group) takes what the global options gave (flag or env; None: not
    given) and the named context; what is missing comes from the config file, read when first needed."""

    def __init__(self, coordinator: str | None = None, tls_dir: str | None = None) -> None:
        from rankctl.cli.contexts import DEFAULT_COORDINATOR

        self.context: str | None = None
        self._given = (coordinator or None, tls_dir or None)
        self._resolved: tuple[str, str | None] | None = (coordinator or DEFAULT_COORDINATOR, tls_dir or None)

    @classmethod
    def from_options(cls, coordinator: str | None, tls_dir: str | None, context: str | None) -> "Ctx":
        ctx = cls(coordinator, tls_dir)
        ctx.context, ctx._resolved = context or None, None
        return ctx

    def _resolve(self) -> tuple[str, str | None]:
        if self._resolved is None:
            from rankctl.cli.contexts import resolve

            self._resolved = resolve(*self._given, self.context)
        return self._resolved

    @property
    def configured(self) -> bool:
        """A coordinator was chosen (flag, env or context), not only the default address."""
        if self._resolved is not None and self.context is None:   # Ctx(coordinator=ADDR): that one, or the default
            return self._given[0] is not None
        from rankctl.cli.contexts import configured

        return configured(self._given[0], self.context)

    @property
    def coordinator(self) -> str:
        return self._resolve()[0]

    @property
    def tls_dir(self) -> str | None:
        """The caller's identity directory (mutual TLS); None: plain text."""
        return self._resolve()[1]

    @property
    def given_tls_dir(self) -> str | None:
        """The TLS directory of the global flag or RANKCTL_TLS_DIR only, never a config context's: a daemon's
        identity is its own (a context holds a user's certificate)."""
        return self._given[1]

    def client(self) -> "Client":
        from rankctl.cli.client import Client

        return Client(self.coordinator, tls_dir=self.tls_dir)


pass_ctx = click.make_pass_decorator(Ctx)
