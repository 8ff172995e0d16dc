"""``ctl certs``: make a CA and issue the node and user certificates that mTLS needs.

Each command writes one identity directory (ca.pem, cert.pem, key.pem) and prints its path on
stdout (``--json``: ``{"dir": ...}``); the CA key stays in CA_DIR and never leaves it.
"""

from __future__ import annotations

from pathlib import Path

import click

from rankctl.cli.errors import EXIT_USAGE, CtlError
from rankctl.cli.options import SuggestingGroup, example, json_option

days_option = click.option("--days", default=825, show_default=True, type=click.IntRange(min=1),
                           help="Days the certificate is valid (never past the CA's end; docs/operations.md).")


@click.group("certs", cls=SuggestingGroup, epilog=example("ctl certs init ./ca --san coord.example.com",
                                     "ctl certs issue ./ca --node node-3 --out ./node-3"))
def certs() -> None:
    """Create a CA and issue node and user certificates (one identity directory each)."""


@certs.command("init", short_help="Make a CA and the coordinator's identity directory.",
               epilog=example("ctl certs init ./ca --san coord.example.com --san 10.0.0.2"))
@click.argument("ca_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--san", "sans", multiple=True, metavar="HOST_OR_IP",
              help="A name or address clients dial the coordinator by (repeatable; loopback is always added).")
@days_option
@json_option
def init(ca_dir: Path, sans: tuple[str, ...], days: int, as_json: bool) -> None:
    """Make a CA in CA_DIR (ca.pem, ca-key.pem) and the coordinator's identity directory
    CA_DIR/coordinator. Refuses when CA_DIR already holds a CA. Prints the directory (--json: {"dir"})."""
    from rankctl.security.certs import init_ca

    _done(_run(lambda: init_ca(ca_dir, list(sans), days=days)), as_json)


@certs.command("issue", short_help="Issue a node's or a user's identity directory.",
               epilog=example("ctl certs issue ./ca --node node-3 --san 10.0.0.13 --out ./node-3",
                              "ctl certs issue ./ca --user alice --role submitter --out ~/.rankctl/alice"))
@click.argument("ca_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--node", metavar="NAME", help="Issue a worker node's certificate (its name is also a SAN).")
@click.option("--user", metavar="NAME", help="Issue a user's certificate (needs --role).")
@click.option("--role", metavar="ROLE", help="The user's role: viewer, submitter or admin.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The identity directory to write (its key.pem must not exist yet).")
@click.option("--san", "sans", multiple=True, metavar="HOST_OR_IP",
              help="Another name or address the node is dialled by (repeatable).")
@days_option
@json_option
def issue(ca_dir: Path, node: str | None, user: str | None, role: str | None, out_dir: Path,
          sans: tuple[str, ...], days: int, as_json: bool) -> None:
    """Issue an identity directory OUT (ca.pem, cert.pem, key.pem) from the CA in CA_DIR, for a
    node (--node) or a user (--user with --role). Prints the directory (--json: {"dir"})."""
    from rankctl.security.certs import issue as issue_dir

    _done(_run(lambda: issue_dir(ca_dir, out_dir, node=node, user=user, role=role, sans=sans, days=days)),
          as_json)


@certs.command("revoke", short_help="Revoke a node's or a user's certificates (the CA's CRL).",
               epilog=example("ctl certs revoke ./ca --node node-3", "ctl certs revoke ./ca --serial 1234567"))
@click.argument("ca_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--node", metavar="NAME", help="Revoke every certificate the CA issued to this node.")
@click.option("--user", metavar="NAME", help="Revoke every certificate the CA issued to this user.")
@click.option("--serial", type=click.IntRange(min=1), metavar="N", help="Revoke the certificate with this serial.")
@json_option
def revoke(ca_dir: Path, node: str | None, user: str | None, serial: int | None, as_json: bool) -> None:
    """Add certificates to the CA's revocation list and write it (an X.509 CRL) to CA_DIR/crl.pem and
    CA_DIR/coordinator/crl.pem. Services refuse them within seconds, no restart; copy crl.pem into each
    worker's --tls-dir (and any other coordinator identity directory) yourself. Prints the serials revoked
    (--json: {"revoked", "crl"})."""
    from rankctl.security.certs import revoke as revoke_certs

    serials, crl = _run(lambda: revoke_certs(ca_dir, node=node, user=user, serial=serial))
    if as_json:
        from rankctl.cli.view.console import print_json

        print_json({"revoked": serials, "crl": str(crl)})
    else:
        click.echo("\n".join(str(s) for s in serials))
        click.echo(f"revoked {len(serials)} certificate(s); the list is {crl}", err=True)


def _run(make):  # noqa: ANN001, ANN202 - a callable; its result
    from rankctl.security.certs import CertError

    try:
        return make()
    except CertError as exc:
        raise CtlError(str(exc), EXIT_USAGE) from None
    except OSError as exc:
        raise CtlError(f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc), EXIT_USAGE) from None


def _done(path: Path, as_json: bool) -> None:
    if as_json:
        from rankctl.cli.view.console import print_json

        print_json({"dir": str(path)})
    else:
        click.echo(str(path))
