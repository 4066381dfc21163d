"""``hourglass spark ...``: the Spark jobs from the command line (typer sub-app).

    hourglass spark audit DATA... --out audit-out [--grace-ms 30000] [--late-ms 1000]
    hourglass spark bulk-schedule rows.csv --out bulk-out --delay 127.0.0.1:7001 [--rate 5000]

Both run on ``local[*]`` unless ``--master`` says otherwise. Under ``spark-submit`` (which
starts this file with ``PYSPARK_GATEWAY_PORT`` set) the master comes from the submit
command::

    spark-submit --master spark://host:7077 --py-files hourglass.zip \\
        cluster/spark/cli.py audit /shared/nodes --out /shared/audit

pyspark is imported only when a command runs, so ``hourglass`` works without the
``spark`` extra installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Spark jobs: audit delivery from node logs, schedule a dataset in bulk.")

DEFAULT_CLUSTER_FILE = Path("var/dev/cluster.json")

MasterOpt = typer.Option(None, "--master", help="Spark master; default local[*] (or spark-submit's)")


def _session(master: Optional[str], app_name: str, driver_memory: Optional[str] = None):
    try:
        from cluster.spark.session import LOCAL_MASTER, SessionSettings, build_session
    except ImportError as e:  # pragma: no cover - depends on the installation
        typer.echo(f"pyspark is not installed: pip install 'hourglass-broker[spark]' ({e})", err=True)
        raise typer.Exit(2)
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    chosen = master or (None if under_submit else LOCAL_MASTER)
    return build_session(SessionSettings(master=chosen, app_name=app_name, driver_memory=driver_memory))


def _delay_nodes(delay: Optional[str], cluster_file: Optional[Path]) -> list[str]:
    nodes = [a.strip() for a in (delay or os.environ.get("HOURGLASS_DELAY_NODES", "")).split(",") if a.strip()]
    cf = cluster_file or DEFAULT_CLUSTER_FILE
    if not nodes and cf.exists():
        nodes = list(json.loads(cf.read_text())["delay"])
    if not nodes:
        typer.echo("no delay nodes: give --delay, set HOURGLASS_DELAY_NODES, or --cluster-file", err=True)
        raise typer.Exit(2)
    return nodes


@app.command("audit")
def audit(
    data: List[str] = typer.Argument(..., help="node data folders, or folders holding them"),
    out: Path = typer.Option(Path("audit-out"), "--out", help="output folder (Parquet, summary.json, report)"),
    as_of_ms: Optional[int] = typer.Option(None, help="audit time for 'overdue' (epoch ms); default now"),
    grace_ms: int = typer.Option(30_000, help="not received by due + grace = lost"),
    late_ms: int = typer.Option(1_000, help="deliveries later than this are listed as late"),
    report: bool = typer.Option(True, help="write report.html and PNG plots"),
    master: Optional[str] = MasterOpt,
    driver_memory: Optional[str] = typer.Option(None, help="e.g. 4g (local mode: all of Spark's memory)"),
) -> None:
    """Lost, duplicated, delivered-after-cancel messages and lateness per subject and hour."""
    from cluster.spark.audit import AuditSettings, run

    spark = _session(master, "hourglass-audit", driver_memory)
    summary = run(spark, AuditSettings(paths=data, out=str(out), as_of_ms=as_of_ms, grace_ms=grace_ms,
                                       late_ms=late_ms, report=report))
    from cluster.spark.report import verdict

    typer.echo(json.dumps(summary, sort_keys=True))
    typer.echo(verdict(summary))
    if report:
        typer.echo(f"report: {out / 'report.html'}")


@app.command("bulk-schedule")
def bulk_schedule(
    input: str = typer.Argument(..., help="CSV (with header), JSON lines or Parquet file/folder"),
    out: Path = typer.Option(Path("bulk-out"), "--out", help="results/, rejects/ and summary.json go here"),
    fmt: Optional[str] = typer.Option(None, "--format", help="csv | json | parquet (default: from the name)"),
    delay: Optional[str] = typer.Option(None, "--delay", help="delay node addresses, comma separated"),
    cluster_file: Optional[Path] = typer.Option(None, "--cluster-file", help="cluster.json of `hourglass dev up`"),
    rate: float = typer.Option(0, "--rate", help="messages per second for the whole job; 0 = unlimited"),
    batch: int = typer.Option(500, "--batch", help="messages per SendBatch"),
    partitions: int = typer.Option(0, help="repartition the input into this many tasks (0 = as read)"),
    payload_encoding: str = typer.Option("utf8", help="utf8 | base64 for text payload columns"),
    master: Optional[str] = MasterOpt,
) -> None:
    """Schedule every row of a dataset; bad rows go to the reject file with their reason."""
    from cluster.spark.bulk import BulkSettings, run

    nodes = _delay_nodes(delay, cluster_file)
    spark = _session(master, "hourglass-bulk-schedule")
    summary = run(spark, BulkSettings(input=input, out=str(out), delay_nodes=nodes, format=fmt, rate_per_s=rate,
                                      batch_max=batch, partitions=partitions, payload_encoding=payload_encoding))
    typer.echo(json.dumps(summary, sort_keys=True))
    if summary["rejected"] or summary["failed"]:
        typer.echo(f"{summary['rejected']} rejected, {summary['failed']} failed: see {out / 'rejects'}")
        raise typer.Exit(1)


if __name__ == "__main__":  # spark-submit cluster/spark/cli.py ...
    app()
