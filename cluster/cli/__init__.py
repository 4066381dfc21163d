"""The ``hourglass`` command line (typer).

    hourglass demo                      start a local cluster, schedule, show deliveries, stop
    hourglass dev up                    a local cluster that runs until Ctrl-C
    hourglass node --role delay ...     one node process (what containers run)
    hourglass send SUBJECT PAYLOAD --delay-ms 5000 [--count N]
    hourglass consume SUBJECT --group G [--count N]
    hourglass cancel ID | lookup ID | trace ID | status
    hourglass console                   the web console (docs/console.md)
    hourglass certs ca | issue | token  certificates and tokens of a secure cluster

Client commands find the cluster through ``--meta``/``--delay``/``--realtime`` addresses,
an explicit ``--cluster-file``, the ``HOURGLASS_META_SERVERS``/``HOURGLASS_DELAY_NODES``/
``HOURGLASS_REALTIME_NODES`` variables, or the ``var/dev/cluster.json`` that ``hourglass dev up``
writes (in that order).

One module per command group: ``common`` (the error boundary, the app, finding the
cluster, shared options), ``servers`` (node, metaserver), ``demo``, ``messages`` (send,
consume, cancel, lookup), ``status``, ``console`` (console, trace), ``dev`` (dev up, dev chaos), ``admin`` (verify,
handover), ``spark`` (the Spark jobs). This module assembles them.

Errors (docs/cli.md): every failure leaves through one boundary (``HourglassApp.__call__``) as
one ``error:`` line and at most one ``hint:`` line on stderr, with an exit code from
``EXIT_CODES``; never a traceback unless ``HOURGLASS_DEBUG=1``. Arguments are checked before
any network call, and every command that talks to the cluster runs under ``--timeout-s``.
"""


from __future__ import annotations

import sys

from cluster.cli import console, demo, messages, servers, status  # noqa: F401  (their commands join ``app``)
from cluster.cli.admin import admin
from cluster.cli.certs import certs_app
from cluster.cli.common import app
from cluster.cli.dev import dev
from cluster.cli.spark import app as spark_app  # imports pyspark only when a command runs

app.add_typer(dev, name="dev")
app.add_typer(spark_app, name="spark")
app.add_typer(admin, name="admin")
app.add_typer(certs_app, name="certs")

__all__ = ["app", "main"]


def main() -> None:  # pragma: no cover
    sys.exit(app())
