"""``hourglass certs``: CAs, node, client and etcd certificates, and tokens (docs/security.md).

    hourglass certs ca --dir secrets/                        ca.crt, ca.key (the node CA)
    hourglass certs ca --dir client-ca/ --name hourglass-client-ca
    hourglass certs issue node n1 --dir secrets/ --host n1.hourglass.svc
    hourglass certs issue client orders-service --dir client-ca/ --out orders/
    hourglass certs issue etcd-client meta --dir etcd-ca/
    hourglass certs token orders-service --auth-file secrets/auth.json \\
        --allow produce:orders.* --allow consume:orders.*@billing --out secrets/orders.token
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

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
       name: str = typer.Option("hourglass-ca", "--name", help="the CA's common name; give the node, client "
                                                                "and etcd CAs different ones"),
       days: int = typer.Option(1825, min=1, max=36500)) -> None:
    """A new certificate authority (keep ca.key offline). One for nodes (everyone needs its
    ca.crt), one for clients (servers: HOURGLASS_TLS_CLIENT_CA_FILE) and one for etcd (etcd and
    the meta servers only): docs/security.md."""
    from cluster.certs import make_ca

    if (dir / "ca.key").exists():
        raise CliError(f"{dir / 'ca.key'} exists", hint="hint: a new CA invalidates every certificate; "
                                                       "remove it first if that is what you want")
    with _writing(dir):
        crt, _ = make_ca(dir, name=name, days=days)
    _say(f"wrote {crt} and {dir / 'ca.key'} (owner-only)")


@certs_app.command("issue")
def issue(kind: str = typer.Argument(..., help="node | client | etcd-member | etcd-client"),
          name: str = typer.Argument(..., help="common name becomes KIND:NAME (node:NAME, client:NAME ...)"),
          dir: Path = typer.Option(..., "--dir", help="the CA's folder (ca.crt, ca.key)"),
          out: Optional[Path] = typer.Option(None, "--out", help="where the certificate and key are written "
                                                                 "(default: the CA's folder)"),
          host: list[str] = typer.Option(["127.0.0.1", "localhost"], "--host",
                                         help="(node, etcd-member) addresses and DNS names it serves on"),
          days: int = typer.Option(365, min=1, max=3650)) -> None:
    """A certificate signed by the CA in --dir: `node` ones (node CA) may replicate, dispatch and
    register; `client` ones (client CA) must also show a token; `etcd-member` (etcd's serving and
    peer certificate) and `etcd-client` (the meta servers') come from etcd's own CA. Re-issue over
    the same files to rotate: servers and clients read them again without a restart."""
    from cluster.certs import KINDS
    from cluster.certs import issue as do_issue

    if kind not in KINDS:
        raise CliError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if not (dir / "ca.key").is_file():
        raise CliError(f"no CA in {dir}", hint="hint: hourglass certs ca --dir DIR")
    server = KINDS[kind][1]
    with _writing(out or dir):
        crt, key = do_issue(dir, out or dir, name, kind=kind, hosts=host if server else (), days=days)
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
