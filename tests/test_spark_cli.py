"""The Spark pipeline's edges that need no Spark: the ``hourglass spark`` command line refuses
wrong paths, options and outputs with one line and exit 2 *before* Spark starts; the data
source's options; the output folder; the reject file's JSON; the report's figures.

The CLI cases run the real ``hourglass`` script in a subprocess (as a user would) and
must end within seconds: a check that came after Spark's start-up (~20 s) would not.
(The Spark side of the same fixes - empty inputs, refused options inside Spark, pushdown -
is in ``tests/test_spark.py``, which shares one SparkSession.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from cluster.errors import InvalidArgument

ROOT = Path(__file__).resolve().parent.parent
HOURGLASS = shutil.which("hourglass", path=str(Path(sys.executable).parent)) or shutil.which("hourglass")
RUN_TIMEOUT_S = 60
SPARK_RUN_TIMEOUT_S = 300  # a command that starts Spark on the shared 2-core machine
NO_JVM = {"JAVA_HOME": "/nonexistent/hourglass-test-no-jvm"}  # a refusal must need no Spark (no JVM can start)


def hg(*args: str, cwd: Path, timeout_s: float = RUN_TIMEOUT_S, env_extra: dict | None = None
       ) -> tuple[int, str, str, float]:
    assert HOURGLASS, "the hourglass script is not installed (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOURGLASS_")} | {"COLUMNS": "80"} \
        | (env_extra or {})
    t0 = time.monotonic()
    p = subprocess.run([HOURGLASS, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout_s, env=env,
                       stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def refused(cwd: Path, *args: str, words: tuple[str, ...]) -> None:
    """Refused in one line with ``words``, before Spark starts: the command runs with a
    JAVA_HOME where no JVM is, so a command that started Spark would fail otherwise (an
    outcome, not a time: a starved machine may take long even to refuse)."""
    code, out, err, took = hg(*args, cwd=cwd, env_extra=NO_JVM)
    what = f"exit {code} in {took:.1f} s\nstdout: {out[-1500:]}\nstderr: {err[-1500:]}"
    assert code == 2, what
    assert "Traceback" not in out + err, what
    lines = err.splitlines()  # the CLI's convention (docs/cli.md): one error line, at most one hint
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), what
    assert len(lines) == 1 or lines[1].startswith("hint: "), what
    for w in words:
        assert w in lines[0], (w, what)


def node_dirs(root: Path) -> Path:
    """A delay node folder and a real-time node folder (empty logs): enough for the checks."""
    (root / "delay-1" / "dispatch").mkdir(parents=True)
    (root / "realtime-1" / "index").mkdir(parents=True)
    return root


def test_cli_refuses_bad_paths_and_outputs_before_spark_starts(tmp_path):
    data = node_dirs(tmp_path / "data")
    (tmp_path / "empty").mkdir()
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "notes.txt").write_text("mine")
    refused(tmp_path, "spark", "audit", str(tmp_path / "nope"), words=("invalid path", "does not exist"))
    refused(tmp_path, "spark", "audit", str(tmp_path / "empty"), words=("no node data folder",))
    refused(tmp_path, "spark", "audit", str(data), "--out", str(tmp_path / "earlier"),
            words=("--out", "exists", "--overwrite"))
    refused(tmp_path, "spark", "audit", str(data), "--out", str(tmp_path / "earlier"), "--overwrite",
            words=("not an earlier output",))
    refused(tmp_path, "spark", "audit", str(data), "--grace-ms", "-5", words=("--grace-ms",))
    rows = tmp_path / "rows.csv"
    rows.write_text("id,subject,deliver_at\nx,s,1\n")
    refused(tmp_path, "spark", "bulk-schedule", str(tmp_path / "missing.parquet"), "--delay", "127.0.0.1:7001",
            words=("missing.parquet", "does not exist"))
    refused(tmp_path, "spark", "bulk-schedule", str(rows), "--format", "xml", "--delay", "127.0.0.1:7001",
            words=("--format", "xml"))
    refused(tmp_path, "spark", "bulk-schedule", str(rows), "--delay", "no-port", words=("--delay", "host:port"))
    refused(tmp_path, "spark", "bulk-schedule", str(rows), words=("no delay nodes",))
    refused(tmp_path, "spark", "bulk-schedule", str(rows), "--delay", "127.0.0.1:7001", "--payload-encoding", "hex",
            words=("payload-encoding",))
    refused(tmp_path, "spark", "bulk-schedule", str(rows), "--delay", "127.0.0.1:7001", "--out",
            str(tmp_path / "earlier"), words=("--out", "exists"))
    refused(tmp_path, "spark", "audit", str(data), "--master", "bogus://x", words=("--master", "bogus://x"))
    refused(tmp_path, "spark", "bulk-schedule", str(rows), "--delay", "127.0.0.1:7001", "--master", "bogus://x",
            words=("--master",))
    # a dataset without the required columns: one error up front, not one reject per row
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "no-due.csv").write_text("id,payload\n" + "".join(f"r{i},x\n" for i in range(100)))
    (inputs / "no-due.json").write_text("".join(json.dumps({"id": f"r{i}", "subject": "s"}) + "\n" for i in range(100)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a"], "deliver_at": [1]}), inputs / "no-subject.parquet")
    for name, missing in (("no-due.csv", "subject, deliver_at"), ("no-due.json", "deliver_at"),
                          ("no-subject.parquet", "subject")):
        refused(tmp_path, "spark", "bulk-schedule", str(inputs / name), "--delay", "127.0.0.1:7001",
                words=("invalid input", f"has no {missing} column", "required: id, subject, deliver_at"))
    # nothing was created by the refused runs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "earlier", "empty", "inputs", "rows.csv"]


@pytest.mark.unit  # tier: a path check, no Spark
def test_the_quiet_log4j_file_is_where_the_cli_looks():
    """The CLI quiets Spark's log with a file beside the jobs; when the CLI module moved, the
    path pointed nowhere and Spark's WARN lines came back (the check below caught it in CI)."""
    from cluster.cli import spark

    assert spark.LOG4J_QUIET.is_file(), spark.LOG4J_QUIET


def test_a_failure_inside_spark_is_one_error_line_without_a_stack_trace(tmp_path):
    """The one case here that starts Spark: an input that exists but is not Parquet."""
    (tmp_path / "rows.parquet").write_text("not parquet")
    code, out, err, took = hg("spark", "bulk-schedule", "rows.parquet", "--delay", "127.0.0.1:1", "--out", "bulk-out",
                              cwd=tmp_path, timeout_s=SPARK_RUN_TIMEOUT_S)
    what = f"exit {code} in {took:.1f} s\nstdout: {out[-1500:]}\nstderr: {err[-3000:]}"
    assert code == 2, what
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert errors == [err.splitlines()[-1]] and "FAILED_READ_FILE" in errors[0], what
    assert "Traceback" not in err and "\tat org.apache" not in err and "ERROR" not in err, what
    assert len(err.splitlines()) <= 4, what  # the JVM's own start-up lines and the error
    assert not (tmp_path / "bulk-out").exists()


def spark_failure(code: int, out: str, err: str, took: float, *, exit_code: int) -> list[str]:
    """The error lines of a run that failed inside Spark: one ``error:`` line (and at most a
    hint) at the end, no Python traceback, no Java stack trace. Returns the ``error:`` lines."""
    what = f"exit {code} in {took:.1f} s\nstdout: {out[-1500:]}\nstderr: {err[-3000:]}"
    assert code == exit_code, what
    lines = err.splitlines()
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, what
    assert lines.index(errors[0]) >= len(lines) - 2 and all(ln.startswith("hint: ") for ln in
                                                            lines[lines.index(errors[0]) + 1:]), what
    assert "Traceback" not in err and "\tat " not in err and "Exception" not in err.replace(errors[0], ""), what
    assert len(lines) <= 5, what  # the JVM's own start-up lines, the error and its hint
    return errors


def test_spark_side_failures_are_one_line(tmp_path):
    """Failures only Spark finds, through the real command: a master URL Spark refuses, a
    folder of random bytes (exit 1: not an empty cluster), and a JVM killed mid-job."""
    import psutil

    from tests.test_spark import random_node_folders

    data = node_dirs(tmp_path / "data")
    errors = spark_failure(*hg("spark", "audit", str(data), "--master", "local[0]", "--out", str(tmp_path / "o1"),
                               cwd=tmp_path, timeout_s=SPARK_RUN_TIMEOUT_S), exit_code=1)
    assert "locally with 0 threads" in errors[0], errors

    noise = random_node_folders(tmp_path / "noise")
    code, out, err, took = hg("spark", "audit", str(noise), "--out", str(tmp_path / "o2"), cwd=tmp_path,
                              timeout_s=SPARK_RUN_TIMEOUT_S)
    errors = spark_failure(code, out, err, took, exit_code=1)
    assert "no log yields a good record: 3 torn/corrupt records in 3 segment files" in errors[0], errors
    assert "noise/delay-1/" in errors[0], errors
    assert out.splitlines()[-2].startswith("PROBLEMS: no log yields a good record"), out
    assert (tmp_path / "o2" / "report.html").exists()  # the report says which files, record by record

    # the JVM dies while the job runs (what the kernel's OOM killer does): one line, exit 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOURGLASS_")}
    p = subprocess.Popen([HOURGLASS, "spark", "audit", str(noise), "--out", str(tmp_path / "o3")], cwd=tmp_path,
                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + SPARK_RUN_TIMEOUT_S
        killed = False
        while not killed and p.poll() is None and time.monotonic() < deadline:
            try:  # processes come and go while this looks (a worker exits): look again
                kids = psutil.Process(p.pid).children(recursive=True)
                java = [k for k in kids if k.name() == "java"]
                # a Python worker under the JVM: the session is up and a job is running
                if java and any("python" in k.name() for k in java[0].children(recursive=True)):
                    java[0].kill()
                    killed = True
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.05)
        out, err = p.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert killed, err[-2000:]
    errors = spark_failure(p.returncode, out, err, 0.0, exit_code=1)
    assert "JVM" in errors[0] or "Spark job failed" in errors[0], errors


@pytest.mark.unit  # tier: the mapping alone, no Spark
def test_spark_errors_are_said_in_their_own_words():
    from cluster.cli.common import explain
    from cluster.cli.spark import spark_error

    def fake(module: str, name: str, text: str) -> BaseException:
        cls = type(name, (Exception,), {"__module__": module})
        return cls(text)

    cases = [(fake("py4j.protocol", "Py4JJavaError", "java.lang.OutOfMemoryError: Java heap space\n\tat x.y"),
              1, "out of memory (Java heap space)"),
             (fake("py4j.protocol", "Py4JNetworkError", "Answer from Java side is empty"), 1, "JVM is gone"),
             (ConnectionRefusedError(111, "Connection refused"), 1, "JVM is gone"),
             (fake("pyspark.errors.exceptions.base", "PySparkRuntimeError",
                   "[JAVA_GATEWAY_EXITED] Java gateway process exited before sending its port number."),
              1, "JVM is gone"),
             (fake("py4j.protocol", "Py4JJavaError", "org.apache.spark.SparkException: Could not parse Master URL: "
                                                     "'x'\n\tat org.apache"), 2, "invalid --master: Could not parse"),
             (fake("pyspark.errors.exceptions.captured", "AnalysisException", "[PATH_NOT_FOUND] Path does not exist"),
              2, "Spark cannot read it: [PATH_NOT_FOUND]")]
    for exc, code, words in cases:
        got_code, lines = explain(spark_error(exc))
        assert got_code == code and words in lines[0] and len(lines) <= 2, (exc, got_code, lines)
        assert all("\n" not in ln for ln in lines)
    plain = ValueError("ours")
    assert spark_error(plain) is plain  # not Spark's: the CLI's boundary treats it as a bug


def test_spark_submit_binds_a_local_driver_to_the_loopback_interface(tmp_path):
    """``spark-submit --master local[1]`` without SPARK_LOCAL_IP: the session the jobs build
    binds the driver (and so the address its UI and block manager advertise) to 127.0.0.1."""
    submit = shutil.which("spark-submit")
    if submit is None:
        pytest.skip("spark-submit is not on PATH")
    script = tmp_path / "where.py"
    script.write_text("from cluster.spark.session import SessionSettings, build_session\n"
                      "s = build_session(SessionSettings(master=None))\n"
                      "print('driver', s.conf.get('spark.driver.bindAddress'), s.sparkContext.uiWebUrl)\n"
                      "s.stop()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_LOCAL_IP", "PYSPARK_GATEWAY_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([submit, "--master", "local[1]", str(script)], capture_output=True, text=True, env=env,
                       timeout=SPARK_RUN_TIMEOUT_S, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "driver 127.0.0.1 http://127.0.0.1:" in p.stdout, (p.stdout, p.stderr[-2000:])


def test_bulk_schedule_help_lists_the_input_columns(tmp_path):
    code, out, err, _ = hg("spark", "bulk-schedule", "--help", cwd=tmp_path)
    assert code == 0, err
    for column in ("id", "subject", "deliver_at", "payload", "tags", "ISO-8601", "base64"):
        assert column in out, out


# ---------------------------------------------------------------------- data source options


def test_options_are_checked_with_the_valid_names_listed(tmp_path):
    from cluster.spark import options

    node_dirs(tmp_path)
    o = options.parse({"path": str(tmp_path), "LOG": "Dispatch", "payload": "TRUE", "pushdown": "false"})
    assert (o.paths, o.log, o.payload, o.pushdown) == ([str(tmp_path)], "dispatch", True, False)
    assert options.parse({"paths": json.dumps([str(tmp_path)])}).paths == [str(tmp_path)]
    cases = [({"path": str(tmp_path), "logs": "dispatch"}, "unknown option 'logs'; valid options: path, log, payload"),
             ({"path": str(tmp_path), "payload": "yes"}, "invalid payload: 'yes' is not true or false"),
             ({"path": str(tmp_path), "pushdown": "0"}, "invalid pushdown"),
             ({"path": str(tmp_path), "log": "bogus"}, "'bogus' is not one of message, schedule, dispatch, realtime"),
             ({"path": str(tmp_path), "recordBytesMax": "big"}, "not a number of bytes"),
             ({"path": str(tmp_path), "recordBytesMax": "0"}, "is not in 1.."),
             ({"path": str(tmp_path / "nope")}, "does not exist"),
             ({}, "give node data folders")]
    for given, words in cases:
        with pytest.raises(InvalidArgument) as ei:
            options.parse(given)
        assert words in str(ei.value), (given, str(ei.value))


def test_script_load_refuses_wrong_options_before_spark(tmp_path):
    """``source.load`` checks in the calling process: no Spark needed to be told (``spark=None``)."""
    from cluster.spark.source import load

    node_dirs(tmp_path)
    with pytest.raises(InvalidArgument, match="unknown option 'logs'"):
        load(None, str(tmp_path), logs="dispatch")
    with pytest.raises(InvalidArgument, match="'yes' is not true or false"):
        load(None, [str(tmp_path)], payload="yes")
    with pytest.raises(InvalidArgument, match="does not exist"):
        load(None, str(tmp_path / "nope"), log="dispatch")


def test_pushed_filters_are_reported_with_pruned_segments(tmp_path):
    """What ``explain()`` cannot show for a Python data source: the reader's pruning line."""
    from pyspark.sql.datasource import EqualTo, In

    from cluster.spark.source import HourglassReader, _PushdownReader

    for node in ("delay-1", "delay-2"):
        (tmp_path / node / "dispatch").mkdir(parents=True)
        for base in (0, 100):
            (tmp_path / node / "dispatch" / f"{base:020d}.log").write_bytes(b"")
    r = _PushdownReader([str(tmp_path)], "dispatch", with_payload=False, record_bytes_max=1 << 20)
    assert list(r.pushFilters([EqualTo(("node",), "delay-2"), EqualTo(("seq",), 5)])) == [EqualTo(("seq",), 5)]
    segs, pruning = r.plan()
    assert [s.node for s in segs] == ["delay-2", "delay-2"]
    assert pruning.line() == ("hourglass scan log=dispatch pushed=[node = 'delay-2'] segments_read=2 "
                              "segments_pruned=2 bytes_read=0")
    list(r.pushFilters([In(("node",), ("delay-1", "delay-9"))]))
    assert r.plan()[1].segments_read == 2
    # no segment at all (a node that is not there): one empty partition, read as nothing
    list(r.pushFilters([EqualTo(("node",), "delay-9")]))
    assert r.partitions() == []
    from pyspark.sql.datasource import InputPartition

    plain = HourglassReader([str(tmp_path)], "dispatch", with_payload=False, record_bytes_max=1 << 20)
    assert list(plain.read(InputPartition(None))) == [] and list(plain.read(None)) == []


# ---------------------------------------------------------------------- outputs


def test_output_folder_is_refused_replaced_only_when_asked_and_never_left_half_written(tmp_path):
    from cluster.spark import outdir

    out = tmp_path / "out"
    with outdir.writing(out, overwrite=False) as w:
        (w / "summary.json").write_text("{}")
        assert not out.exists()  # written aside, renamed at the end
    assert (out / "summary.json").exists()
    with pytest.raises(InvalidArgument, match="exists"):
        outdir.check(out, overwrite=False)
    with pytest.raises(RuntimeError):
        with outdir.writing(out, overwrite=True) as w:
            (w / "summary.json").write_text('{"new": 1}')
            raise RuntimeError("the job failed")
    assert (out / "summary.json").read_text() == "{}"  # the earlier output stays
    with outdir.writing(out, overwrite=True) as w:
        (w / "summary.json").write_text('{"new": 1}')
    assert json.loads((out / "summary.json").read_text()) == {"new": 1}
    with pytest.raises(RuntimeError):
        with outdir.writing(tmp_path / "fresh", overwrite=False):
            raise RuntimeError("the job failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no empty folder, no partial one
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("x")
    with pytest.raises(InvalidArgument, match="not an earlier output"):
        outdir.check(tmp_path / "home", overwrite=True)


def test_reject_source_is_valid_json_however_long_the_row():
    from cluster.spark.bulk import SOURCE_FIELD_CHARS_MAX, _source

    row = {"id": "x", "subject": "no spaces", "payload": "\u00e9\"\\" * 5000, "tags": ["t" * 50] * 100,
           "raw": b"\x00" * 9000, "deliver_at": datetime(2027, 1, 15, tzinfo=timezone.utc), "none": None}
    got = json.loads(_source(row))
    assert got["id"] == "x" and got["subject"] == "no spaces" and "none" not in got
    assert got["payload"].startswith("\u00e9\"\\") and got["payload"].endswith("[cut: 15000 characters]")
    assert len(got["payload"]) < SOURCE_FIELD_CHARS_MAX + 40
    assert got["raw"].endswith("characters]") and got["deliver_at"] == "2027-01-15T00:00:00+00:00"
    assert isinstance(got["tags"], str) and got["tags"].startswith('["ttt')  # a long list: its JSON, cut
    assert json.loads(_source({"id": "y", "tags": ["a", "b"]})) == {"id": "y", "tags": ["a", "b"]}


# ---------------------------------------------------------------------- report figures


def report_rows(hours: int):
    h0 = datetime(2026, 11, 23, 11, tzinfo=timezone.utc)
    lateness, hourly = [], []
    for h in range(hours):
        hour = h0 + timedelta(hours=h)
        for k, s in enumerate(("a.orders", "b.billing", "c.push")):
            delivered = 0 if (s == "c.push" and h == 0) else 100 - k
            lateness.append(dict(subject=s, hour=hour, delivered=delivered, lost=2 if delivered == 0 else 0,
                                 duplicated=1 if k == 1 else 0, delivered_after_cancel=0, late=k, early=0, pending=0,
                                 cancelled=0, p50_ms=5 if delivered else None, p90_ms=50 if delivered else None,
                                 p99_ms=300 * (k + 1) if delivered else None, p999_ms=None,
                                 max_ms=3000 if delivered else None))
        lateness.append(dict(subject="d.later", hour=hour, delivered=0, lost=0, duplicated=0,
                             delivered_after_cancel=0, late=0, early=0, pending=4, cancelled=1, p50_ms=None,
                             p90_ms=None, p99_ms=None, p999_ms=None, max_ms=None))
        hourly.append(dict(hour=hour, delivered=297, p50_ms=5, p90_ms=50, p99_ms=900, p999_ms=2000, max_ms=3000))
    summary = {"scheduled": 307, "late": 3, "early": 0, "late_ms": 1000, "status": {
        "delivered": 296, "duplicated": 1, "lost": 2, "delivered_after_cancel": 0, "cancelled": 4, "pending": 4}}
    return summary, lateness, hourly


@pytest.mark.parametrize("hours", [1, 30])
def test_report_figures_say_what_they_show(hours):
    import matplotlib.pyplot as plt

    from cluster.spark.report import figures

    summary, lateness, hourly = report_rows(hours)
    figs = figures(summary, lateness, hourly)
    try:
        assert sorted(figs) == ["heatmap.png", "lateness.png", "problems.png", "status.png"]
        for name, fig in figs.items():
            for ax in fig.axes:
                if ax.get_label() == "<colorbar>":
                    assert ax.get_ylabel(), name
                    continue
                assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), (name, ax)
        status = figs["status.png"].axes[0]
        assert [t.get_text() for t in status.get_yticklabels()][-2:] == ["late", "early"]
        assert "296" in [t.get_text() for t in status.texts]  # the count at its bar
        assert status.get_xlim()[1] > 296 * 10  # room for it inside the frame
        assert "0" in [t.get_text() for t in status.texts]  # zero counts are said, not left out
        lat = figs["lateness.png"].axes[0]
        threshold = [ln for ln in lat.get_lines() if list(ln.get_ydata()) == [1000, 1000]]
        assert threshold and "late above" in threshold[0].get_label()
        assert "UTC" in lat.get_xlabel() and len(lat.get_yticks()) >= 3
        heat = figs["heatmap.png"].axes[0]
        if hours <= 24:  # values in the cells, and a cell says everything it holds
            texts = [t.get_text() for t in heat.texts]
            assert "2 lost" in texts and any(t.endswith(" ms") for t in texts)
            assert "4 pending\n1 cancelled" in texts, texts  # the cell with nothing delivered
        bar = next(ax for ax in figs["heatmap.png"].axes if ax.get_label() == "<colorbar>")
        figs["heatmap.png"].canvas.draw()
        assert "1.0 s: late above" in [t.get_text() for t in bar.get_yticklabels()]  # the threshold, said
        fail_ax, late_ax = figs["problems.png"].axes
        assert fail_ax.get_title().startswith("Failures") and late_ax.get_title().startswith("Late")
        assert {t.get_text() for t in fail_ax.get_yticklabels()} >= {"c.push", "b.billing"}
    finally:
        for f in figs.values():
            plt.close(f)
    # nothing late, nothing failed: each panel says so in one sentence
    calm = [dict(r, late=0, lost=0, duplicated=0) for r in lateness]
    figs = figures(dict(summary, late=0), calm, hourly)
    try:
        fail_ax, late_ax = figs["problems.png"].axes if "problems.png" in figs else (None, None)
        assert fail_ax is None  # nothing to show: the figure is left out
    finally:
        for f in figs.values():
            plt.close(f)
    figs = figures(summary, [dict(r, late=0) for r in lateness], hourly)
    try:
        fail_ax, late_ax = figs["problems.png"].axes
        assert [t.get_text() for t in late_ax.texts] == ["No delivery was later\nthan 1.0 s."]
    finally:
        for f in figs.values():
            plt.close(f)


def test_report_tables_read_as_times_and_durations(tmp_path):
    from cluster.spark.report import duration, utc, write_report

    assert utc(1795435895288) == "2026-11-23 12:11:35.288Z" and utc(None) == "-"
    assert [duration(v) for v in (None, 5, 1500, 120_000, 7_200_000)] == ["-", "5 ms", "1.5 s", "2.0 min", "2.0 h"]
    summary, lateness, hourly = report_rows(1)
    summary |= {"records_read": 900, "seconds": 3.2, "as_of_ms": 1795435895288, "grace_ms": 30000,
                "received_not_scheduled": 0, "corrupt_records": 0}
    examples = {"lost": [dict(subject="c.push", id="p-1", nodes="delay-1", due_ms=1795434875288, received=0,
                              dispatched=0, lateness_ms=None, first_received_ms=None, reason="never dispatched")]}
    page = write_report(tmp_path, summary, lateness, hourly, examples, []).read_text()
    assert "2026-11-23 11:54:35.288Z" in page and "1795434875288" not in page.split("<h2>Summary")[0]
    assert "None" not in page.split("<h2>Summary")[0]
    assert "lost: 2 (first 1 shown)" in page and "delivered after cancel: none" in page
    assert all((tmp_path / n).stat().st_size > 5000 for n in ("status.png", "lateness.png", "heatmap.png"))


# ---------------------------------------------------------------------- audit figures (pure)


@pytest.mark.unit  # tier: pure, against a naive model
def test_histogram_figures_match_a_sort_of_every_lateness():
    """``cluster.spark.stats`` against the obvious model: the per subject-hour, hourly and overall
    counts and nearest-rank percentiles of the raw rows, sorted. Exact below 1 s; above, at most
    1% low; the maximum always exact."""
    import math
    import random

    from cluster.spark import stats

    rnd = random.Random(11)
    raw = []
    for _ in range(3000):
        status = rnd.choice(["delivered"] * 6 + ["duplicated", "lost", "pending", "cancelled"])
        lat = None
        if status in ("delivered", "duplicated"):
            lat = rnd.choice([rnd.randrange(0, 60), rnd.randrange(0, 5000), rnd.randrange(0, 10**7)])
        raw.append(dict(hour=rnd.randrange(3), subject=rnd.choice("ab"), status=status, lateness_ms=lat,
                        late=lat is not None and lat > 1000, early=status == "delivered" and rnd.random() < 0.01))
    groups: dict[tuple, dict] = {}
    for r in raw:
        k = (r["hour"], r["subject"], r["status"], r["late"], r["early"],
             None if r["lateness_ms"] is None else stats.bucket(r["lateness_ms"]))
        g = groups.setdefault(k, {"n": 0, "max_ms": None})
        g["n"] += 1
        if r["lateness_ms"] is not None:
            g["max_ms"] = max(g["max_ms"] or 0, r["lateness_ms"])
    hist = [dict(zip(("hour", "subject", "status", "late", "early", "bucket"), k)) | g for k, g in groups.items()]
    lateness, hourly, overall = stats.figures(hist)

    def model(rows):
        lat = sorted(r["lateness_ms"] for r in rows if r["lateness_ms"] is not None)
        out = {s: sum(r["status"] == s for r in rows) for s in stats.STATUSES}
        out["delivered"] += out["duplicated"]
        out |= {"late": sum(r["late"] for r in rows), "early": sum(r["early"] for r in rows),
                "max_ms": lat[-1] if lat else None}
        for name, p in stats.PERCENTILES:
            out[name] = lat[max(1, math.ceil(p * len(lat) - 1e-9)) - 1] if lat else None
        return out

    def same(got, want):
        for k, v in want.items():
            if k.endswith("_ms") and k != "max_ms" and v is not None and v >= stats.EXACT_BELOW_MS:
                assert 0.99 * v <= got[k] <= v, (k, got[k], v)
            else:
                assert got[k] == v, (k, got[k], v)

    assert len(lateness) == 6 and [h["hour"] for h in hourly] == [0, 1, 2]
    for row in lateness:
        same(row, model([r for r in raw if (r["hour"], r["subject"]) == (row["hour"], row["subject"])]))
    for row in hourly:
        same(row, model([r for r in raw if r["hour"] == row["hour"]]))
    same(overall, model(raw))
    assert [stats.bucket(v) for v in (0, 999, 1000, 12_345, 9_876_543)] == [0, 999, 1000, 12_300, 9_870_000]
    assert stats.percentiles({0: 2, 5: 1, 7: 1, 40: 1}) == {"p50_ms": 5, "p90_ms": 40, "p99_ms": 40, "p999_ms": 40}


def test_py4j_tracebacks_on_the_root_logger_are_dropped_when_quiet():
    """A JVM killed mid-call makes py4j call ``logging.exception`` on the root logger (a
    traceback on stderr, and ``basicConfig`` on the way): quiet, those records are dropped;
    the CLI's own and other libraries' records still go out."""
    import logging

    from cluster.cli.spark import _NotFromPy4j, silence_py4j

    root = logging.getLogger()
    silence_py4j()
    silence_py4j()  # once is enough: no second filter
    try:
        assert sum(isinstance(f, _NotFromPy4j) for f in root.filters) == 1
        gone = root.makeRecord("root", logging.ERROR, "/x/site-packages/py4j/java_gateway.py", 1056,
                               "Exception while sending command.", (), None)
        kept = root.makeRecord("root", logging.ERROR, "/x/cluster/cli/spark.py", 1, "ours", (), None)
        assert not root.filter(gone) and root.filter(kept)
    finally:
        for f in [f for f in root.filters if isinstance(f, _NotFromPy4j)]:
            root.removeFilter(f)
