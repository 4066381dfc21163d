"""``hourglass spark ...``: the Spark jobs from the command line (typer sub-app).

    hourglass spark audit DATA... --out audit-out [--grace-ms 30000] [--late-ms 1000]
    hourglass spark bulk-schedule rows.csv --out bulk-out --delay 127.0.0.1:7001 [--rate 5000]

Both run on ``local[*]`` unless ``--master`` says otherwise. Under ``spark-submit`` (which
starts this file with ``PYSPARK_GATEWAY_PORT`` set) the master comes from the submit
command::

    spark-submit --master spark://host:7077 --py-files hourglass.zip \\
        cluster/spark_submit.py audit /shared/nodes --out /shared/audit

pyspark is imported only when a command runs, so ``hourglass`` works without the
``spark`` extra installed.

Errors leave through the ``hourglass`` CLI's boundary (``cluster.cli.common.HourglassApp``,
also under spark-submit, whose entry file ``cluster/spark_submit.py`` runs the whole CLI): what the command line can get wrong (paths, ``--format``, ``--delay``,
``--out``...) is checked before Spark starts and raised as ``InvalidArgument`` (one line,
exit 2); a failure inside Spark becomes one line too (``_spark_errors``), and Spark's own
log is off unless ``HOURGLASS_DEBUG=1``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer

from cluster.cli.common import EXIT_FAILED, CliError
from cluster.errors import HourglassError, InvalidArgument
from cluster.spark import options, outdir
from node.store.settings import REALTIME_DEFAULTS

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Spark jobs: audit delivery from node logs, schedule a dataset in bulk.")

DEFAULT_CLUSTER_FILE = Path("var/dev/cluster.json")
# Spark's start-up WARN lines off: the file lives beside the Spark jobs (cluster/spark/)
LOG4J_QUIET = Path(options.__file__).with_name("log4j2-cli.properties")
INPUT_FORMATS = ("csv", "json", "parquet")
PAYLOAD_ENCODINGS = ("utf8", "base64")

# Spark error classes that mean "the input is not what it should be": exit 2, like a bad argument
INPUT_ERROR_CLASSES = ("PATH_NOT_FOUND", "FAILED_READ_FILE", "UNABLE_TO_INFER_SCHEMA", "MALFORMED_RECORD",
                       "INVALID_PARQUET", "CANNOT_READ_FILE")

MasterOpt = typer.Option(None, "--master", help="Spark master: local[N], spark://host:port, yarn, k8s://https://host:port; "
                                                 "default local[*] (or spark-submit's)")
# the master URLs Spark 4 knows (SparkContext.createTaskScheduler), checked before Spark starts
MASTER_FORMS = re.compile(r"local(\[(\*|\d+)(,\s*\d+)?\])?|local-cluster\[\d+,\s*\d+,\s*\d+\]|"
                          r"spark://[^\s/]+(,[^\s/]+)*|yarn|k8s://\S+")
# a Spark-side failure that means the JVM is gone: it died (killed, out of memory) or never came up
JVM_GONE = ("Answer from Java side is empty", "Error while receiving", "Error while sending",
            "JAVA_GATEWAY_EXITED", "Connection refused", "SparkContext was shut down")
OUT_OF_MEMORY = ("OutOfMemoryError", "Java heap space", "GC overhead limit exceeded", "System memory")
HINT_JVM = ("hint: the JVM was killed or ran out of memory: give it more (--driver-memory 4g), "
            "HOURGLASS_DEBUG=1 shows Spark's log and the trace")
OverwriteOpt = typer.Option(False, "--overwrite", help="replace an earlier output in --out (else an existing --out "
                                                      "is refused)")


def _check_master(master: Optional[str]) -> None:
    if master is not None and not MASTER_FORMS.fullmatch(master.strip()):
        raise InvalidArgument("--master", f"{master[:64]!r} is not a Spark master URL: local[N], local[*], "
                                          "spark://host:port, yarn or k8s://https://host:port")


def _quiet() -> bool:
    return os.environ.get("HOURGLASS_DEBUG", "") in ("", "0")


class _NotFromPy4j(logging.Filter):
    """Drops records py4j logs on the root logger: ``java_gateway`` calls
    ``logging.exception("Exception while sending command.")`` (a traceback) when the JVM dies
    mid-call; records of other loggers that reach the root are not filtered here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "/py4j/" not in record.pathname.replace("\\", "/")


def silence_py4j() -> None:
    """py4j's own logging off (its logger and its records on the root logger), once."""
    logging.getLogger("py4j").setLevel(logging.CRITICAL + 1)
    root = logging.getLogger()
    if not any(isinstance(f, _NotFromPy4j) for f in root.filters):
        root.addFilter(_NotFromPy4j())


def _session(master: Optional[str], app_name: str, driver_memory: Optional[str] = None):
    try:
        from cluster.spark.session import LOCAL_MASTER, SessionSettings, build_session
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise HourglassError(f"pyspark is not installed: pip install 'hourglass-broker[spark]' ({e})") from None
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    chosen = master or (None if under_submit else LOCAL_MASTER)
    # a failed task is said once, by _spark_errors; Spark's own ERROR lines (a stack trace per
    # task) only with HOURGLASS_DEBUG=1
    quiet = _quiet()
    if quiet:  # py4j logs a dead JVM's broken socket with a traceback; the CLI says it in one line
        silence_py4j()
    conf = {}
    if quiet and LOG4J_QUIET.is_file():  # read only when this process starts the JVM (not under spark-submit)
        conf["spark.driver.extraJavaOptions"] = f"-Dlog4j.configurationFile={LOG4J_QUIET.as_uri()}"
    return build_session(SessionSettings(master=chosen, app_name=app_name, driver_memory=driver_memory,
                                         log_level="OFF" if quiet else "WARN", conf=conf))


@contextmanager
def _spark_errors() -> Iterator[None]:
    """A failure inside Spark (a Py4J error, an AnalysisException, a failed task) leaves as one
    ``HourglassError`` line naming Spark's error class, not a JVM stack trace. What the job
    itself raises on purpose (``HourglassError``) passes through."""
    try:
        yield
    except HourglassError:
        raise
    except Exception as e:
        raise spark_error(e) from None


def spark_error(e: BaseException) -> BaseException:
    """What the CLI says for an exception out of Spark: one line naming Spark's error class
    (``InvalidArgument`` for an input Spark cannot read, exit 2), the JVM's death (killed, out
    of memory) with a hint; anything that is not Spark's is returned as it is."""
    module = type(e).__module__ or ""
    if not module.startswith(("pyspark", "py4j")) and not isinstance(e, (ConnectionError, EOFError)):
        return e
    try:
        java = getattr(e, "java_exception", None)  # Py4JJavaError: the message is the Java exception's
        text = (str(java) if java is not None else str(e)).strip()
    except Exception:  # the JVM is gone: even the Java exception's text cannot be fetched
        text = str(getattr(e, "errmsg", "") or type(e).__name__)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("JVM stacktrace")),
                 type(e).__name__)
    first = re.sub(r"^(org\.apache\.spark\.|java\.lang\.)\w+: ", "", first)
    if "Could not parse Master URL" in first or "Master must either be" in first:
        return InvalidArgument("--master", first)
    if any(w in text for w in OUT_OF_MEMORY):
        return CliError(f"the Spark job failed: out of memory ({first})", code=EXIT_FAILED, hint=HINT_JVM)
    if isinstance(e, (ConnectionError, EOFError)) or type(e).__name__ == "Py4JNetworkError" or any(
            w in text for w in JVM_GONE):
        return CliError(f"the Spark job failed: Spark's JVM is gone ({first})", code=EXIT_FAILED, hint=HINT_JVM)
    if type(e).__name__ == "AnalysisException" or any(f"[{c}" in first for c in INPUT_ERROR_CLASSES):
        return InvalidArgument("input", f"Spark cannot read it: {first}")
    return HourglassError(f"the Spark job failed: {first}")


def _delay_nodes(delay: Optional[str], cluster_file: Optional[Path]) -> list[str]:
    nodes = [a.strip() for a in (delay or os.environ.get("HOURGLASS_DELAY_NODES", "")).split(",") if a.strip()]
    cf = cluster_file or DEFAULT_CLUSTER_FILE
    if not nodes and (cluster_file is not None or cf.exists()):
        try:
            nodes = [str(a) for a in json.loads(cf.read_text())["delay"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidArgument("--cluster-file", f"{cf} cannot be read as a cluster file ({e})") from None
    if not nodes:
        raise InvalidArgument("--delay", "no delay nodes: give --delay, set HOURGLASS_DELAY_NODES, or --cluster-file")
    for a in nodes:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument("--delay", f"{a[:64]!r} is not host:port")
    return nodes


def _input_format(input: str, fmt: Optional[str]) -> str:
    chosen = (fmt or Path(input.rstrip("/")).suffix.lstrip(".")).lower()
    chosen = "json" if chosen == "jsonl" else chosen
    if chosen not in INPUT_FORMATS:
        said = f"--format {fmt!r}" if fmt else f"the name {input[:64]!r}"
        raise InvalidArgument("--format", f"{said} is not one of {', '.join(INPUT_FORMATS)}; give --format")
    return chosen


def _check_input(input: str) -> None:
    if options.is_local(input) and not Path(input.removeprefix("file://").removeprefix("file:")).exists():
        raise InvalidArgument("input", f"{input} does not exist")


@app.command("audit")
def audit(
    data: List[str] = typer.Argument(..., help="node data folders, or folders holding them"),
    out: Path = typer.Option(Path("audit-out"), "--out", help="output folder (Parquet, summary.json, report); "
                                                            "must not exist unless --overwrite"),
    overwrite: bool = OverwriteOpt,
    as_of_ms: Optional[int] = typer.Option(None, min=0, help="audit time for 'overdue' (epoch ms); default now"),
    grace_ms: int = typer.Option(30_000, min=0, help="not received by due + grace = lost"),
    late_ms: int = typer.Option(1_000, min=0, help="deliveries later than this are listed as late"),
    hold_ms: int = typer.Option(REALTIME_DEFAULTS.visible_hold_ms_max, min=0, help="the real-time nodes' visible_hold_ms_max: a message stored "
                                                 "further ahead of its due time was handed out early"),
    report: bool = typer.Option(True, help="write report.html and PNG plots"),
    master: Optional[str] = MasterOpt,
    driver_memory: Optional[str] = typer.Option(None, help="e.g. 4g (local mode: all of Spark's memory)"),
) -> None:
    """Lost, duplicated, delivered-after-cancel messages and lateness per subject and hour."""
    from cluster.spark.audit import CORRUPT_FILES_SHOWN_MAX, AuditSettings, run
    from cluster.spark.report import verdict

    # everything the command line can get wrong is checked before Spark starts (~20 s)
    _check_master(master)
    if any(options.is_local(p) for p in data):
        options.check_has_nodes([p for p in data if options.is_local(p)])
    outdir.check(out, overwrite=overwrite)
    settings = AuditSettings(paths=data, out=str(out), as_of_ms=as_of_ms, grace_ms=grace_ms, late_ms=late_ms,
                             hold_ms=hold_ms, report=report, overwrite=overwrite)
    with _spark_errors():
        spark = _session(master, "hourglass-audit", driver_memory)
        summary = run(spark, settings)
    typer.echo(json.dumps(summary, sort_keys=True))
    typer.echo(verdict(summary))
    if report:
        typer.echo(f"report: {out / 'report.html'}")
    if summary["no_good_record"]:  # a folder of random bytes is not an empty cluster: exit 1
        files = summary["corrupt_files"]
        raise HourglassError(f"no log yields a good record: {summary['corrupt_records']:,} torn/corrupt records in "
                             f"{len(files)}{'+' if len(files) >= CORRUPT_FILES_SHOWN_MAX else ''} segment files, the first "
                             f"{files[0]['segment'] if files else '-'} (the report lists them)")


BULK_HELP = """Schedule every row of a dataset; bad rows go to the reject file with their reason.

\b
Input columns (CSV with a header, JSON one object a line, Parquet):
  id          required; reruns stay idempotent (ASCII, <= 128 bytes)
  subject     required; letters, digits, . _ - (first a letter/digit)
  deliver_at  required; epoch ms, ISO-8601 (no zone: UTC), timestamp
  payload     optional; UTF-8 text, base64 (--payload-encoding), binary
  tags        optional; a list, or one string "a,b"
Other columns are ignored. Exit 1 when a row was rejected or failed.
"""


@app.command("bulk-schedule", help=BULK_HELP)
def bulk_schedule(
    input: str = typer.Argument(..., help="CSV (with header), JSON lines or Parquet file/folder"),
    out: Path = typer.Option(Path("bulk-out"), "--out", help="results/, rejects/ and summary.json go here; "
                                                           "must not exist unless --overwrite"),
    overwrite: bool = OverwriteOpt,
    fmt: Optional[str] = typer.Option(None, "--format", help="csv | json | parquet (default: from the name)"),
    delay: Optional[str] = typer.Option(None, "--delay", help="delay node addresses, comma separated"),
    cluster_file: Optional[Path] = typer.Option(None, "--cluster-file", help="cluster.json of `hourglass dev up`"),
    rate: float = typer.Option(0, "--rate", min=0, help="messages per second for the whole job; 0 = unlimited"),
    batch: int = typer.Option(500, "--batch", min=1, max=10_000, help="messages per SendBatch"),
    partitions: int = typer.Option(0, min=0, help="repartition the input into this many tasks (0 = as read)"),
    payload_encoding: str = typer.Option("utf8", help="utf8 | base64 for text payload columns"),
    master: Optional[str] = MasterOpt,
) -> None:
    from cluster.spark.bulk import BulkSettings, run

    _check_master(master)
    _check_input(input)
    chosen = _input_format(input, fmt)
    if payload_encoding not in PAYLOAD_ENCODINGS:
        raise InvalidArgument("--payload-encoding", f"{payload_encoding[:64]!r} is not one of utf8, base64")
    nodes = _delay_nodes(delay, cluster_file)
    outdir.check(out, overwrite=overwrite)
    if options.is_local(input):  # the required columns, once, from the file's header or schema
        from cluster.spark.bulk import check_local_columns

        check_local_columns(input.removeprefix("file://").removeprefix("file:"), chosen)
    settings = BulkSettings(input=input, out=str(out), delay_nodes=nodes, format=chosen, rate_per_s=rate,
                            batch_max=batch, partitions=partitions, payload_encoding=payload_encoding,
                            overwrite=overwrite)
    with _spark_errors():
        spark = _session(master, "hourglass-bulk-schedule")
        summary = run(spark, settings)
    typer.echo(json.dumps(summary, sort_keys=True))
    if summary["rejected"] or summary["failed"]:
        typer.echo(f"{summary['rejected']} rejected, {summary['failed']} failed: see {out / 'rejects'}")
        raise typer.Exit(1)
