"""``hourglass certs``: a CA, node and client certificates, and tokens (docs/security.md).

    hourglass certs ca --dir secrets/                        ca.crt, ca.key
    hourglass certs issue node n1 --dir secrets/ --host n1.hourglass.svc
    hourglass certs issue client orders-service --dir secrets/
    hourglass certs token orders-service --auth-file secrets/auth.json \\
        --allow produce:orders.* --allow consume:orders.*@billing --out secrets/orders.token
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import typer

from cluster.cli.common import CliError, console

def _say(line: str) -> None:
    console.print(line, markup=False, highlight=False)


@contextmanager
def _writing(where: Path):
    """A file that cannot be read or written (a folder of another user, a full disk) is one line."""
    try:
        yield
    except OSError as e:
        raise CliError(f"cannot write in {where}: {e.strerror or e}"
                       + (f" ({e.filename})" if e.filename else "")) from None


certs_app = typer.Typer(help="Certificates and tokens for a secure cluster (docs/security.md).", no_args_is_help=True)


@certs_app.command("ca")
def ca(dir: Path = typer.Option(..., "--dir", help="where ca.crt and ca.key are written"),
       days: int = typer.Option(1825, min=1, max=36500)) -> None:
    """A new certificate authority (keep ca.key offline; nodes and clients need ca.crt)."""
    from cluster.certs import make_ca

    if (dir / "ca.key").exists():
        raise CliError(f"{dir / 'ca.key'} exists", hint="hint: a new CA invalidates every certificate; "
                                                       "remove it first if that is what you want")
    with _writing(dir):
        crt, _ = make_ca(dir, days=days)
    _say(f"wrote {crt} and {dir / 'ca.key'} (owner-only)")


@certs_app.command("issue")
def issue(kind: str = typer.Argument(..., help="node | client"),
          name: str = typer.Argument(..., help="common name becomes node:NAME or client:NAME"),
          dir: Path = typer.Option(..., "--dir", help="the CA's folder; the certificate is written here too"),
          host: list[str] = typer.Option(["127.0.0.1", "localhost"], "--host",
                                         help="(node) addresses and DNS names the node serves on"),
          days: int = typer.Option(365, min=1, max=3650)) -> None:
    """A certificate signed by the CA: `node` ones may replicate, dispatch and register; `client`
    ones must also show a token. Re-issue over the same files to rotate: servers and clients
    read them again without a restart."""
    from cluster.certs import issue as do_issue

    if kind not in ("node", "client"):
        raise CliError(f"kind must be node or client, not {kind!r}")
    if not (dir / "ca.key").is_file():
        raise CliError(f"no CA in {dir}", hint="hint: hourglass certs ca --dir DIR")
    with _writing(dir):
        crt, key = do_issue(dir, dir, name, kind=kind, hosts=host if kind == "node" else (), days=days)
    _say(f"wrote {crt} and {key} (owner-only)")


def _grants(allow: list[str]):
    from pydantic import ValidationError

    from cluster.security import Grant

    grants = []
    for a in allow:
        action, _, rest = a.partition(":")
        subjects, _, groups = rest.partition("@")
        try:
            grants.append(Grant(action=action, **({"subjects": subjects.split(",")} if subjects else {}),
                                **({"groups": groups.split(",")} if groups else {})))
        except ValidationError:
            raise CliError(f"--allow {a!r}: the action must be produce, consume, cancel or admin") from None
        if grants[-1].action.value in ("node", "discover"):
            raise CliError(f"--allow {a!r}: {action} is not granted to tokens (node certificates only)")
    if not grants:
        raise CliError("give at least one --allow")
    return grants


ALLOW_HELP = "ACTION[:SUBJECTS[@GROUPS]], e.g. produce:orders.*, consume:orders.*@billing, cancel, admin (repeatable)"


@certs_app.command("token")
def token(name: str = typer.Argument(..., help="who the token is for (logged on refusals)"),
          auth_file: Path = typer.Option(..., "--auth-file", help="the servers' HOURGLASS_AUTH_FILE"),
          allow: list[str] = typer.Option([], "--allow", help=ALLOW_HELP),
          out: Path = typer.Option(..., "--out", help="where the token is written (owner-only)")) -> None:
    """A new token with its grants. Only its SHA-256 goes into the auth file; the servers read the
    file again within a second. Giving an existing NAME replaces that token (rotation)."""
    from cluster.certs import add_token

    grants = _grants(allow)
    with _writing(auth_file.parent):
        add_token(auth_file, name, grants, out)
    _say(f"token {name!r} written to {out}; its digest is in {auth_file}")


@certs_app.command("grant")
def grant(name: str = typer.Argument(..., help="who it is (logged on refusals)"),
          certificate: str = typer.Option(..., "--certificate", help="the client certificate's common name, "
                                                                      "e.g. client:orders"),
          auth_file: Path = typer.Option(..., "--auth-file", help="the servers' HOURGLASS_AUTH_FILE"),
          allow: list[str] = typer.Option([], "--allow", help=ALLOW_HELP)) -> None:
    """Let a client certificate act without a token: calls that carry no token and show this
    certificate get these grants."""
    from cluster.certs import grant_certificate

    if certificate.startswith("node:"):
        raise CliError("node certificates may do everything already; grant client certificates only")
    grants = _grants(allow)
    with _writing(auth_file.parent):
        grant_certificate(auth_file, name, certificate, grants)
    _say(f"certificate {certificate!r} ({name!r}) granted in {auth_file}")
