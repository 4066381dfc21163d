"""Parts of a node's ``Admin/Status`` document that both roles carry (issue 31, the console's
Cluster page): role changes over the last hour, and disk used and free.

``RoleChanges`` is pure (time comes in as ``now_ms``) and bounded: it keeps the times of the
last ``kept_max`` changes, so a storm of changes reads as at least ``kept_max``, never grows
memory. A node counts its own changes (a slave reports its own view); the times live in
memory, so after a restart the count starts again (the restart itself is not a change).

Example: changes noted at 10:00, 10:40 and 11:05; at 11:10 with a 1 h window, two are
within it (10:40, 11:05): ``count(now_ms) == 2``.
"""

from __future__ import annotations

from collections import deque


class RoleChanges:
    def __init__(self, *, window_ms: int, kept_max: int) -> None:
        assert window_ms > 0 and kept_max > 0
        self.window_ms = window_ms
        self._times: deque[int] = deque(maxlen=kept_max)

    def note(self, now_ms: int) -> None:
        """The node became master or stopped being one at ``now_ms``."""
        self._times.append(now_ms)

    def count(self, now_ms: int) -> int:
        """Changes in ``(now_ms - window_ms, now_ms]``."""
        edge = now_ms - self.window_ms
        return sum(1 for t in self._times if edge < t <= now_ms)


def disk_status(disk, sizes: dict[str, int] | None) -> dict[str, int | None]:
    """``{"used_bytes", "free_bytes", "total_bytes"}``: what the node's files take (the last
    retention pass's sizes, ``None`` before the first) and the data disk's last reading
    (``DiskMonitor.reading``; ``None`` before the first)."""
    r = disk.reading
    read = disk.budget.free_bytes is not None
    return {"used_bytes": None if sizes is None else int(sum(sizes.values())),
            "free_bytes": r.free_bytes if read else None, "total_bytes": r.total_bytes if read else None}


__all__ = ["RoleChanges", "disk_status"]
