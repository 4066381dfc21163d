"""``hourglass dev``: a local development cluster.

    hourglass dev up [--replicas 2 --ack-mode sync]   a supervised cluster that runs until Ctrl-C
    hourglass dev up --delay-groups 2 --realtime-groups 3 [--replicas 2]   any shape (docs/cli.md)
    hourglass dev chaos --kills 3 [--seed 7]          traffic + seeded master kills against it, verdict
    hourglass dev chaos --scenario meta-pause         a named scenario (issue 26), or --kinds node_stall,...

``dev up`` resolves its data folder once, at the start (the processes run with the repository
as their working directory), restarts a process that dies on its own data after a backoff
(``cluster.devcluster.Supervisor``), logs one line per event, and prints child output as plain
text (a node's log may hold ``[...]``, which is not markup). SIGINT/SIGTERM stop every process it
started, by PID.

Exit codes: 0 stopped by SIGINT/SIGTERM, or a chaos run that passed; 1 the cluster did not start,
or a chaos run with violations; 2 bad options or no cluster; 130 interrupted while starting.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from cluster.devcluster import DELAY_GROUPS_MAX, REALTIME_GROUPS_MAX, REPLICAS_MAX, ClusterShape, RestartPolicy

dev = typer.Typer(help="Local development cluster.", no_args_is_help=True)
console = Console()
err_console = Console(stderr=True)

DEFAULT_DATA = Path("var/dev")
_DEFAULT_POLICY = RestartPolicy()


class KillGroups(str, Enum):
    delay = "delay"
    realtime = "realtime"
    any = "any"


KILL_ROLES = {KillGroups.delay: ("delay",), KillGroups.realtime: ("realtime",), KillGroups.any: ("delay", "realtime")}


class AckMode(str, Enum):
    async_ = "async"
    sync = "sync"


def say(line: str) -> None:
    """One timestamped line, never read as Rich markup (child output may hold ``[/...]``)."""
    console.print(f"{time.strftime('%H:%M:%S')} {line}", markup=False, highlight=False, soft_wrap=True)


def fail(message: str, code: int) -> typer.Exit:
    """One ``error:`` line on stderr (the form of the other commands, docs/cli.md) and the exit to raise."""
    err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True, style="red")
    return typer.Exit(code)


# ---------------------------------------------------------------------- dev up


@dev.command("up")
def up(data: Path = typer.Option(DEFAULT_DATA, help="data folder of the whole cluster"),
       meta: bool = typer.Option(True, "--meta/--static",
                                 help="start etcd and a meta server; nodes register and discover there"),
       delay_groups: int = typer.Option(1, min=1, max=DELAY_GROUPS_MAX,
                                        help="delay groups; the clients spread sends over them by message id"),
       realtime_groups: int = typer.Option(1, min=1, max=REALTIME_GROUPS_MAX,
                                           help="real-time groups; the meta server routes each new subject to one"),
       replicas: int = typer.Option(1, min=1, max=REPLICAS_MAX,
                                    help="delay nodes in each delay group (2 = master + slave, by election)"),
       realtime_replicas: int = typer.Option(1, min=1, max=REPLICAS_MAX,
                                             help="real-time nodes in each real-time group (2 = master + slave)"),
       ack_mode: AckMode = typer.Option(AckMode.async_, case_sensitive=False,
                                        help="sync: acknowledged once a slave holds it (needs --replicas 2+)"),
       restart_backoff_ms: int = typer.Option(_DEFAULT_POLICY.restart_backoff_ms, min=0, max=600_000,
                                              help="wait this long before restarting a process that died"),
       restarts_max: int = typer.Option(_DEFAULT_POLICY.restarts_max, min=0, max=1000,
                                        help="restarts of one process per --restart-window-ms; then it stays down"),
       restart_window_ms: int = typer.Option(_DEFAULT_POLICY.restart_window_ms, min=1000, max=86_400_000),
       secure: bool = typer.Option(False, "--secure/--open",
                                   help="mutual TLS on every port and tokens checked; client credentials are "
                                        "written beside cluster.json (docs/security.md)"),
       console_: bool = typer.Option(True, "--console/--no-console",
                                     help="start the web console too (docs/console.md) and print its URL"),
       console_port: int = typer.Option(0, min=0, max=65535, help="the console's port (0: a free one)"),
       ) -> None:
    """Start a local cluster (etcd, a meta server, delay and real-time nodes), restart whatever dies, run until Ctrl-C."""
    from cluster.devcluster import LocalCluster, Supervisor
    from cluster.errors import HourglassError

    shape = ClusterShape(delay_groups, realtime_groups, replicas, realtime_replicas)
    bad = shape.problem(meta=meta, ack_mode=ack_mode.value)
    if bad is not None:
        raise typer.BadParameter(bad[1], param_hint=f"'{bad[0]}'")
    data = data.resolve()  # once: the processes do not share the caller's working directory
    policy = RestartPolicy(restart_backoff_ms=restart_backoff_ms, restarts_max=restarts_max,
                           restart_window_ms=restart_window_ms)

    def interrupt(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    # the nodes keep their own meta lease (NodeSettings meta.lease_ttl_ms): a paused master keeps its
    # seat that long (a killed one's port refuses connections: its slave reports it and takes over
    # at once, docs/replication.md)
    cluster = LocalCluster(data, meta=meta, **shape.cluster_kwargs(), ack_mode=ack_mode.value, secure=secure)
    say(f"starting in {data}: " + ("etcd, a meta server, " if meta else "")
        + f"{shape.describe()} (ack_mode={ack_mode.value})")
    if secure:
        say(f"secure: mutual TLS on every port, tokens checked; client credentials in {data / 'security'} "
            f"(cluster.json names them; the admin token is {data / 'security' / 'admin.token'}); "
            f"etcd trusts only its own CA ({data / 'security' / 'etcd'}): the meta servers alone reach it")
    else:
        say("OPEN: plaintext gRPC and no authentication on 127.0.0.1, for local play only; "
            "`hourglass dev up --secure` for TLS and tokens (docs/security.md)")
    try:
        cluster.start()  # stops what it started if it fails or is interrupted
        try:
            cluster.wait_registered()
        except BaseException:
            cluster.stop()
            raise
    except KeyboardInterrupt:
        say("interrupted while starting; every process stopped")
        raise typer.Exit(130)
    except (HourglassError, TimeoutError, OSError) as e:
        raise fail(f"the cluster did not start: {e}", 1)

    info = cluster.describe()
    say(f"cluster up  delay={info['delay']}  realtime={info['realtime']}  meta={info.get('meta', [])}  "
        f"etcd={info.get('etcd', [])}")
    for role, groups in info["groups"].items():
        for group, members in groups.items():
            say(f"  {role} group {group}: {', '.join(members)}")
    for name, p in info["processes"].items():
        say(f"  {name} pid={p['pid']} address={p['address']} log={data / (name + '.log')}")
    say(f"restart policy: backoff {policy.restart_backoff_ms} ms, at most {policy.restarts_max} restarts "
        f"per {policy.restart_window_ms} ms per process")
    say(f"try:  hourglass send demo.hello 'hi' --delay-ms 3000 --cluster-file {data}/cluster.json")
    say(f"      hourglass consume demo.hello --group g --cluster-file {data}/cluster.json")
    say(f"      hourglass status --cluster-file {data}/cluster.json")
    if replicas > 1:
        say(f"      hourglass dev chaos --kills 3 --cluster-file {data}/cluster.json")
    web = None
    try:
        if console_ and meta:
            web = start_console(cluster, data, console_port)
        elif console_:
            say("console: not started (it discovers the cluster through the meta servers; --static has none)")
        asyncio.run(_supervise(Supervisor(cluster, policy)))
    except KeyboardInterrupt:  # a signal between the handlers: stop all the same
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say("stopping ...")
        if web is not None:
            stop_console(web)
        cluster.stop()
        say("cluster stopped")


CONSOLE_START_S_MAX = 30.0  # `dev up` waits this long for the console to answer, then goes on without it
CONSOLE_STOP_S_MAX = 10.0


def start_console(cluster, data: Path, port: int):
    """``hourglass console`` on the dev cluster (HTTPS with the nodes' certificate when
    secure), its output in DATA/console.log; its URL said once it answers. The cluster is
    useful without it: a console that does not start is said, not fatal."""
    import os
    import ssl
    import subprocess
    import sys
    import urllib.request

    from cluster.ports import free_port

    port = port or free_port()
    sec = cluster.security
    args = ["--cluster-file", str(data / "cluster.json"), "--port", str(port)]
    if sec is not None:
        args += ["--https-cert", str(sec.node_cert), "--https-key", str(sec.node_key)]
    url = f"{'https' if sec is not None else 'http'}://127.0.0.1:{port}/"
    log_path = data / "console.log"
    with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "console", *args], stdout=logf,
                                stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2],
                                start_new_session=True)
    ctx = ssl.create_default_context(cafile=str(sec.ca)) if sec is not None else None
    deadline = time.monotonic() + CONSOLE_START_S_MAX
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "healthz", timeout=2, context=ctx):
                say(f"console {url}  pid={proc.pid} log={log_path}"
                    + ("  (log in with a token, e.g. the admin token above)" if sec is not None else "  (OPEN)"))
                return proc
        except OSError:
            time.sleep(0.2)
    say(f"console did not start (see {log_path}); the cluster runs without it")
    stop_console(proc)
    return None


def stop_console(proc) -> None:
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=CONSOLE_STOP_S_MAX)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=CONSOLE_STOP_S_MAX)


async def _supervise(supervisor) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await supervisor.run(stop, say)


# ---------------------------------------------------------------------- dev chaos


@dev.command("chaos")
def chaos(kills: int = typer.Option(3, min=1, max=100, help="masters to SIGKILL, one after the other (of the "
                                                             "groups --kill-groups names)"),
          kill_groups: KillGroups = typer.Option(KillGroups.delay, case_sensitive=False,
                                                 help="whose masters --kills SIGKILLs: delay groups, real-time "
                                                      "groups, or any group"),
          seed: int = typer.Option(1, help="the same seed gives the same kill schedule and traffic"),
          cluster_file: Path = typer.Option(DEFAULT_DATA / "cluster.json", help="cluster.json of `hourglass dev up`"),
          rate: Optional[float] = typer.Option(None, min=1, max=10_000,
                                               help="messages produced per second (default 20, or the scenario's)"),
          kill_gap_s: float = typer.Option(6.0, min=0, max=600, help="mean seconds between a recovery and the next kill"),
          scenario: Optional[str] = typer.Option(None, help="a named scenario (docs/reliability.md): meta-pause, "
                                                            "starved-kills, starved; its own load and faults"),
          kinds: Optional[str] = typer.Option(None, help="comma-separated fault kinds of a seeded random plan instead "
                                                         "of the kills (docs/reliability.md, 'Fault kinds')"),
          duration_s: Optional[float] = typer.Option(None, min=1, max=86_400,
                                                     help="seconds of traffic of --scenario (default its own) or "
                                                          "--kinds (default 60)"),
          cpu_hogs_per_core: int = typer.Option(8, min=1, max=64, help="cpu_starve: busy processes per core"),
          disk_writers: int = typer.Option(2, min=1, max=64, help="disk_saturate: processes appending + fdatasync"),
          throttle_cpu: float = typer.Option(0.2, min=0.01, max=64, help="node_throttle: CPUs the master may use"),
          ack_journal: list[Path] = typer.Option([], help="the HOURGLASS_ACK_JOURNAL file(s) `dev up` ran with: the "
                                                          "run fails if two members acknowledged at once"),
          out: Optional[Path] = typer.Option(None, help="where the run's records go (default: DATA/chaos-SEED-TIME)"),
          as_json: bool = typer.Option(False, "--json", help="print the whole report as JSON"),
          ) -> None:
    """Run traffic against the `dev up` cluster, SIGKILL delay masters on a seeded schedule (or play a
    scenario or other fault kinds), check the records.

    The killed masters are restarted by `dev up`; machine faults (CPU and disk starvation, CPU
    quotas, SIGSTOP stalls) are undone at their end and on Ctrl-C. The verdict (acknowledged,
    lost, duplicates, failover and resume times, master changes, acknowledgement windows) is the
    chaos suite's invariant checker's."""
    from cluster.chaosplan import SCENARIOS
    from cluster.devchaos import DEV_KINDS, DevChaosConfig, run_dev_chaos, scenario_dev_config
    from cluster.errors import HourglassError

    if scenario is not None and scenario not in SCENARIOS:
        raise typer.BadParameter(f"{scenario!r}; known: {', '.join(sorted(SCENARIOS))}", param_hint="'--scenario'")
    kind_list = tuple(k for k in (kinds or "").split(",") if k)
    if set(kind_list) - set(DEV_KINDS):
        raise typer.BadParameter(f"{sorted(set(kind_list) - set(DEV_KINDS))}; dev chaos plays {', '.join(DEV_KINDS)}",
                                 param_hint="'--kinds'")
    if scenario and kind_list:
        raise typer.BadParameter("give --scenario or --kinds, not both", param_hint="'--kinds'")

    cluster_file = cluster_file.resolve()
    if not cluster_file.exists():
        raise fail(f"no cluster file {cluster_file}: start one with `hourglass dev up` (or give --cluster-file)", 2)
    info = json.loads(cluster_file.read_text())
    if not info.get("meta") or "processes" not in info:
        raise fail(f"{cluster_file} is not of a `hourglass dev up --meta` cluster", 2)
    out = (out or cluster_file.parent / f"chaos-{seed}-{int(time.time())}").resolve()
    common = dict(cluster_file=cluster_file, out_dir=out, seed=seed, kills=kills, kill_gap_s=kill_gap_s,
                  kill_roles=KILL_ROLES[kill_groups],
                  cpu_hogs_per_core=cpu_hogs_per_core, disk_writers=disk_writers, throttle_cpu_fraction=throttle_cpu,
                  ack_journals=tuple(p.resolve() for p in ack_journal))
    if scenario:
        cfg = scenario_dev_config(scenario, rate_per_s=rate, duration_s=duration_s, **common)
        what = f"scenario {scenario} for {cfg.duration_s:g} s"
    else:
        cfg = DevChaosConfig(rate_per_s=rate or 20.0, kinds=kind_list, duration_s=duration_s, **common)
        what = f"{', '.join(kind_list)} for {duration_s or 60:g} s" if kind_list else \
            f"{kills} master kill(s) of {kill_groups.value} groups"
    say(f"chaos seed={seed}: {what}, {cfg.rate_per_s:g} msg/s, records in {out}")
    try:
        report = run_dev_chaos(cfg, say=say)
    except KeyboardInterrupt:
        raise fail("interrupted; the records so far are in " + str(out), 130)
    except HourglassError as e:
        raise fail(str(e), 1)
    if as_json:
        console.print_json(json.dumps(report))
    else:
        console.print(verdict_table(report))
        for v in report["violations"]:
            console.print(f"VIOLATION: {v}", markup=False, highlight=False, style="red")
    if not report["passed"]:
        say(f"FAILED; seed={seed} reproduces the schedule; report: {out / 'report.json'}")
        raise typer.Exit(1)
    say(f"passed; report: {out / 'report.json'}")


def verdict_table(report: dict) -> Table:
    f, m, lat = report["faults"], report["messages"], report["lateness_ms"]
    fo, rs, mc, aw = f["failover_ms"], f["resume_ms"], report["master_changes"], report["ack_windows"]
    t = Table("check", "value", title=f"dev chaos seed={report['seed']}: "
              + ("PASSED" if report["passed"] else "FAILED"))
    rows = [
        ("masters killed", str(f["master_kills"] + f["by_kind"].get("realtime_kill", 0))
         + (f" ({f['by_kind']['realtime_kill']} real-time)" if f["by_kind"].get("realtime_kill") else "")
         + (f" ({len(f['skipped'])} skipped)" if f["skipped"] else "")),
        ("sent / acknowledged", f"{m['sent']} / {m['acked']}"),
        ("expected deliveries / received", f"{m['expected_deliveries']} / {m['receives']}"),
        ("lost (acknowledged, never received)", str(report["lost"]["count"])),
        ("duplicates (extra receives)", str(report["duplicates"]["extra_receives"])),
        ("... after an answered ack (allowed across an async failover)",
         "not recorded" if (d := report["duplicates"].get("by_ack")) is None
         else f"{d['after_answered_ack'] + d['after_answered_ack_across_failover']} "
              f"({d['after_answered_ack_across_failover']} across a failover, ack_mode={d['ack_mode']})"),
        ("failover s (kill -> new master) p50 / max",
         "-" if fo["n"] == 0 else f"{fo['p50'] / 1000:.1f} / {fo['max'] / 1000:.1f}"),
        ("resume s (kill -> deliveries again) p50 / max",
         "-" if rs["n"] == 0 else f"{rs['p50'] / 1000:.1f} / {rs['max'] / 1000:.1f}"),
        ("master changes: after a kill / without", f"{mc['after_kill']} / {mc['without_kill']}"),
        ("overlapping acknowledgement windows",
         f"{aw['overlaps']} ({aw['windows']} windows)" if aw["journals"] else "not checked (no journal)"),
        ("other faults", ", ".join(f"{k} {n}" for k, n in sorted(f["by_kind"].items())
                                   if k not in ("delay_master_kill", "realtime_kill"))
         or "-"),
        ("processes not restarted", str(len(report["restart_errors"]))),
        ("lateness ms p50 / p99", f"{lat['all']['p50']} / {lat['all']['p99']}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t
