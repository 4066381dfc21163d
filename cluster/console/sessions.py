"""Viewer sessions of the console: who is logged in with which token, and each session's
CSRF token. Pure bookkeeping: time comes in as ``now_ms``; ids and CSRF tokens are
random (``secrets``).

Invariants: the viewer's token stays in this process's memory, never in a cookie (the
cookie holds only a random session id); at most ``sessions_max`` sessions (the least
recently used goes first); a session idle for ``idle_ms_max`` is gone; a state-changing
request must carry its session's CSRF token (``csrf_ok``), compared in constant time.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

SESSIONS_MAX = 1000          # viewers at once; the least recently used is logged out first
SESSION_IDLE_MS_MAX = 8 * 3_600_000
ID_BYTES = 32


@dataclass
class Session:
    sid: str
    token: str | None          # the viewer's cluster token (None: an open cluster, or not logged in)
    csrf: str
    last_ms: int
    flash: list[str] = field(default_factory=list)


class Sessions:
    def __init__(self, *, sessions_max: int = SESSIONS_MAX, idle_ms_max: int = SESSION_IDLE_MS_MAX) -> None:
        assert sessions_max >= 1 and idle_ms_max >= 1
        self.sessions_max = sessions_max
        self.idle_ms_max = idle_ms_max
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, sid: str | None, now_ms: int) -> Session | None:
        s = self._by_id.get(sid or "")
        if s is None:
            return None
        if now_ms - s.last_ms > self.idle_ms_max:
            del self._by_id[s.sid]
            return None
        s.last_ms = now_ms
        self._by_id.move_to_end(s.sid)
        return s

    def create(self, now_ms: int, token: str | None = None) -> Session:
        """A new session (a login gives it a new id: no fixation of an id seen before login)."""
        while len(self._by_id) >= self.sessions_max:
            self._by_id.popitem(last=False)
        s = Session(secrets.token_urlsafe(ID_BYTES), token, secrets.token_urlsafe(ID_BYTES), now_ms)
        self._by_id[s.sid] = s
        return s

    def drop(self, sid: str | None) -> None:
        self._by_id.pop(sid or "", None)


def csrf_ok(session: Session | None, sent: str | None) -> bool:
    return session is not None and bool(sent) and hmac.compare_digest(session.csrf.encode(), str(sent).encode())
