"""Injectors of the chaos runs' machine-level faults (``cluster/chaosplan.py`` lists the kinds):
CPU starvation, a saturated disk, a cgroup CPU quota on one process, SIGSTOP stalls.

Every fault is undone at its end and at teardown: ``FaultKit`` remembers every helper process
it started (stopped by its PID, SIGKILL then reaped), every cgroup it made (its processes
moved back to where they came from, then the cgroup removed) and every process it froze
(SIGCONT); ``restore_all()`` undoes whatever is still in force (also after a failure or a
cancellation). A helper also exits by itself when its parent is gone (it watches
``getppid``), so a harness that is SIGKILLed does not leave the machine starved.

* **CPU starvation**: ``per_core x cores`` Python processes spinning, at the nice the kit was
  made at (the nodes'). The run's own clients may be boosted meanwhile (``boost_clients``).
* **Disk saturation**: ``writers`` processes each appending ``block_bytes`` and calling
  ``fdatasync`` back to back in a scratch folder (it must be on the data's file system: every
  fsync there, etcd's included, waits behind them); a file is cut back to 0 at
  ``file_bytes_max`` (the cut is a metadata change the journal commits too), deleted at the end.
* **CPU throttle** (``CpuThrottle``): cgroup v1 ``cpu`` controller; a child cgroup
  ``hourglass-chaos-<pid>-<n>`` with ``cpu.cfs_quota_us = fraction x cpu.cfs_period_us``, the
  process moved in (all its threads), moved back and the cgroup removed at the end. Where the
  controller is missing or not writable the fault is *skipped* with the reason (never faked).
  The record carries the cgroup's ``cpu.stat`` at the end (``nr_throttled``: it did bite).
* **Stalls**: SIGSTOP of a PID for the hold, then SIGCONT.

Each ``FaultKit`` coroutine returns the fault's record: ``t_start``/``t_end`` (wall ms), the
PIDs involved, ``restored`` and, where it could not run, ``skipped`` with the reason. A hold
ends early when the kit's ``stop`` event is set (the workload is over).
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster.clock import wall_ms as now_ms

CPU_CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
CFS_PERIOD_US = 100_000
HELPER_STOP_TIMEOUT_S = 10.0
HELPERS_MAX = 512             # hogs of one fault
RMDIR_TRIES_MAX = 50          # a cgroup empties a moment after its last process left
DISK_BLOCK_BYTES = 64 << 10
DISK_FILE_BYTES_MAX = 64 << 20

# argv: parent pid, nice, ...; at the nodes' nice (the caller may run boosted); spin until the
# parent is gone (checked every ~20 ms of spinning)
_CPU_HOG = ("import os,sys\np=int(sys.argv[1])\nos.setpriority(os.PRIO_PROCESS,0,int(sys.argv[2]))\n"
            "while os.getppid()==p:\n    for _ in range(200000): pass\n")
# append + fdatasync back to back; cut the file at the cap; stop when the parent is gone
_DISK_HOG = (
    "import os,sys\n"
    "os.setpriority(os.PRIO_PROCESS,0,int(sys.argv[2]))\n"
    "p,path,block,cap=int(sys.argv[1]),sys.argv[3],int(sys.argv[4]),int(sys.argv[5])\n"
    "fd=os.open(path,os.O_WRONLY|os.O_CREAT|os.O_APPEND,0o644)\n"
    "buf=os.urandom(block)\n"
    "n=0\n"
    "while os.getppid()==p:\n"
    "    os.write(fd,buf); os.fdatasync(fd); n+=block\n"
    "    if n>=cap: os.ftruncate(fd,0); n=0\n"
)


# a launcher prefix: set an absolute nice value, then exec the command (same PID)
_AT_NICE = "import os,sys\nos.setpriority(os.PRIO_PROCESS,0,int(sys.argv[1]))\nos.execvp(sys.argv[2],sys.argv[2:])\n"


CLIENT_NICE_BOOST = 10  # with cpu_starve the clients' process runs this much nicer than the nodes


async def stopped_within(ev: asyncio.Event, delay_s: float) -> bool:
    """Wait ``delay_s`` or until ``ev`` is set (True: it was)."""
    try:
        async with asyncio.timeout(delay_s):
            await ev.wait()
        return True
    except TimeoutError:
        return False


def at_nice(nice: int) -> list[str]:
    """A command prefix (``NodeProcess.prefix``) that starts the command at nice ``nice`` whatever
    the launching thread's is (a boosted harness must not boost the nodes it restarts)."""
    return [sys.executable, "-S", "-c", _AT_NICE, str(nice)]


def cgroup_unavailable(root: Path = CPU_CGROUP_ROOT) -> str | None:
    """Why a CPU quota cannot be set here (None: it can)."""
    if not (root / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {root} (cpu.cfs_quota_us missing)"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable by uid {os.getuid()} (a CPU quota needs root)"
    return None


def _cpu_cgroup_of(pid: int) -> str:
    """The process's cgroup path under the v1 ``cpu`` controller, from /proc/PID/cgroup."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    raise OSError(errno.ENOENT, f"process {pid} is in no cgroup v1 cpu controller")


class CpuThrottle:
    """A CPU quota on one process (and its threads) through a child cgroup of ``root``."""

    _made = 0

    def __init__(self, pid: int, *, cpu_fraction: float, period_us: int = CFS_PERIOD_US,
                 root: Path = CPU_CGROUP_ROOT) -> None:
        if not 0 < cpu_fraction <= 64:
            raise ValueError(f"cpu_fraction {cpu_fraction} is not in (0, 64]")
        CpuThrottle._made += 1
        self.pid = pid
        self.root = Path(root)
        self.period_us = period_us
        self.quota_us = max(1000, int(cpu_fraction * period_us))  # the kernel's minimum is 1 ms
        self.dir = self.root / f"hourglass-chaos-{os.getpid()}-{CpuThrottle._made}"
        self.origin: str | None = None
        self.stat: dict[str, int] = {}

    def start(self) -> None:
        self.origin = _cpu_cgroup_of(self.pid)
        self.dir.mkdir()
        try:
            (self.dir / "cpu.cfs_period_us").write_text(str(self.period_us))
            (self.dir / "cpu.cfs_quota_us").write_text(str(self.quota_us))
            (self.dir / "cgroup.procs").write_text(str(self.pid))
        except OSError:
            self.stop()
            raise

    def stop(self) -> None:
        """Move every process still in the cgroup back where the throttled one came from; remove it."""
        if not self.dir.exists():
            return
        try:
            self.stat = {k: int(v) for k, v in (ln.split() for ln in (self.dir / "cpu.stat").read_text().splitlines())
                         if v.isdigit()}
        except OSError:
            pass
        back = self.root / (self.origin or "/").lstrip("/") / "cgroup.procs"
        for _ in range(RMDIR_TRIES_MAX):
            for pid in (self.dir / "cgroup.procs").read_text().split():
                try:
                    back.write_text(pid)
                except OSError as e:
                    if e.errno != errno.ESRCH:  # gone meanwhile: nothing to move
                        raise
            try:
                self.dir.rmdir()
                return
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
            time.sleep(0.02)
        raise OSError(errno.EBUSY, f"cgroup {self.dir} still busy after {RMDIR_TRIES_MAX} tries")


class FaultKit:
    """Starts machine faults and undoes them; one per run."""

    def __init__(self, scratch_dir: Path, *, stop: asyncio.Event | None = None) -> None:
        self.scratch = Path(scratch_dir)
        self.stop = stop or asyncio.Event()
        self.helpers: dict[int, subprocess.Popen] = {}
        self.throttles: list[CpuThrottle] = []
        self.frozen: set[int] = set()
        self.base_nice = os.getpriority(os.PRIO_PROCESS, 0)  # the nodes' nice; hogs run at it
        self.boosted = False

    # ------------------------------------------------------------ helpers

    def _spawn(self, code: str, *args: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-S", "-c", code, str(os.getpid()), str(self.base_nice), *args],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.helpers[p.pid] = p
        return p

    def stop_helpers(self, pids: list[int]) -> None:
        """SIGKILL by PID and reap."""
        for pid in pids:
            p = self.helpers.pop(pid, None)
            if p is None:
                continue
            if p.poll() is None:
                os.kill(pid, signal.SIGKILL)
            p.wait(timeout=HELPER_STOP_TIMEOUT_S)

    def boost_clients(self, by: int) -> int | str:
        """Lower the calling thread's nice by ``by`` (the clients of a run: a production cluster's
        producers and consumers run on other machines, so starving the machine must not starve the
        load). The nice applied, or why not (not root). Threads started meanwhile inherit it:
        launch processes with ``at_nice(kit.base_nice)``."""
        try:
            os.setpriority(os.PRIO_PROCESS, 0, self.base_nice - by)
        except PermissionError as e:
            return f"not boosted: {e}"
        self.boosted = True
        return self.base_nice - by

    def unboost(self) -> None:
        if self.boosted:
            os.setpriority(os.PRIO_PROCESS, 0, self.base_nice)
            self.boosted = False

    async def _hold(self, hold_s: float) -> None:
        try:
            async with asyncio.timeout(hold_s):
                await self.stop.wait()
        except TimeoutError:
            pass

    # ------------------------------------------------------------ faults

    async def machine_fault(self, kind: str, hold_s: float, *, per_core: int, writers: int) -> dict | None:
        """Play a whole-machine fault (``cpu_starve``, ``disk_saturate``) for ``hold_s``; None for
        other kinds. While the CPUs starve, this process (the clients, "on other machines")
        runs ``CLIENT_NICE_BOOST`` nicer than the nodes, so the load does not starve with them."""
        if kind == "cpu_starve":
            boost = self.boost_clients(CLIENT_NICE_BOOST)
            try:
                return await self.cpu_starve(hold_s, per_core=per_core) | {"client_nice": boost}
            finally:
                self.unboost()
        if kind == "disk_saturate":
            return await self.disk_saturate(hold_s, writers=writers)
        return None

    async def cpu_starve(self, hold_s: float, *, per_core: int) -> dict:
        n = min(HELPERS_MAX, per_core * (os.cpu_count() or 1))
        procs = [self._spawn(_CPU_HOG) for _ in range(n)]
        ev = {"t_start": now_ms(), "helpers": n, "per_core": per_core, "pids": [p.pid for p in procs]}
        try:
            await self._hold(hold_s)
        finally:
            self.stop_helpers([p.pid for p in procs])
            ev.update(t_end=now_ms(), restored=True)
        return ev

    async def disk_saturate(self, hold_s: float, *, writers: int, block_bytes: int = DISK_BLOCK_BYTES,
                            file_bytes_max: int = DISK_FILE_BYTES_MAX) -> dict:
        self.scratch.mkdir(parents=True, exist_ok=True)
        n = min(HELPERS_MAX, writers)
        files = [self.scratch / f"disk-hog-{os.getpid()}-{i}" for i in range(n)]
        procs = [self._spawn(_DISK_HOG, str(f), str(block_bytes), str(file_bytes_max)) for f in files]
        ev = {"t_start": now_ms(), "helpers": n, "block_bytes": block_bytes, "scratch": str(self.scratch),
              "pids": [p.pid for p in procs]}
        try:
            await self._hold(hold_s)
        finally:
            self.stop_helpers([p.pid for p in procs])
            for f in files:
                f.unlink(missing_ok=True)
            ev.update(t_end=now_ms(), restored=True)
        return ev

    async def throttle(self, pid: int, hold_s: float, *, cpu_fraction: float) -> dict:
        reason = cgroup_unavailable()
        if reason:
            return {"skipped": reason, "pid": pid, "t_start": now_ms(), "t_end": now_ms()}
        th = CpuThrottle(pid, cpu_fraction=cpu_fraction)
        try:
            th.start()
        except OSError as e:
            return {"skipped": f"cgroup CPU quota failed: {e}", "pid": pid, "t_start": now_ms(), "t_end": now_ms()}
        self.throttles.append(th)
        ev = {"t_start": now_ms(), "pid": pid, "cgroup": str(th.dir), "quota_us": th.quota_us,
              "period_us": th.period_us}
        try:
            await self._hold(hold_s)
        finally:
            ev.update(self._unthrottle(th), t_end=now_ms())
        return ev

    def _unthrottle(self, th: CpuThrottle) -> dict:
        try:
            th.stop()
        except OSError as e:  # left in self.throttles: restore_all tries again
            return {"restored": False, "restore_error": f"{type(e).__name__}: {e}"}
        self.throttles.remove(th)
        return {"restored": True, "cpu_stat": th.stat}

    async def stall(self, pid: int, hold_s: float) -> dict:
        """SIGSTOP for ``hold_s`` (not cut short by ``stop``: a pause has its length), then SIGCONT."""
        os.kill(pid, signal.SIGSTOP)
        self.frozen.add(pid)
        ev = {"t_start": now_ms(), "pid": pid}
        try:
            await asyncio.sleep(hold_s)
        finally:
            self._cont(pid)
            ev.update(t_end=now_ms(), restored=True)
        return ev

    def _cont(self, pid: int) -> None:
        self.frozen.discard(pid)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # killed meanwhile (another lane): nothing to thaw
            pass

    def restore_all(self) -> list[str]:
        """Undo whatever is still in force; the errors (none expected) as text."""
        errors = []
        self.unboost()
        for pid in list(self.frozen):
            self._cont(pid)
        for th in list(self.throttles):
            r = self._unthrottle(th)
            if not r["restored"]:
                errors.append(f"cgroup {th.dir}: {r['restore_error']}")
        try:
            self.stop_helpers(list(self.helpers))
        except (OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"helpers: {e}")
        return errors
