"""Per-principal subject quotas: a pure core (time comes in as ``now_ms``; no I/O, no clock).

A new subject costs every tenant something (an index file, RAM, a share of the node-wide
``subjects_max``), so each principal (a token's name; ``anonymous`` on an open cluster) may

* create at most ``new_per_minute_max`` subjects per minute: a token bucket of that
  capacity, refilled continuously at ``new_per_minute_max / 60,000`` per millisecond (a
  burst of up to a minute's worth, then the steady rate);
* own at most ``owned_max`` subjects: the ones it created (the owner is persisted with
  the subject, so the count survives a restart: the caller seeds ``owned``).

``admit(principal, n, now_ms)`` grants a prefix of ``n`` new subjects (0..n) and reserves
it: the bucket loses that many tokens and the principal owns that many more at once, so
concurrent requests cannot both take the last one. A request creates fewer than it was
granted (another request created the same name first, the node-wide limit, a failed
write)? ``refund`` gives the difference back. When it grants fewer than ``n`` the answer
carries a ``QuotaExceeded`` naming the limit that stopped it.

Memory: one bucket per principal seen; principals come from the auth file (or are the one
anonymous tenant), and a full bucket equals a fresh one, so buckets that are full are
dropped once there are more than ``BUCKETS_MAX``.

Worked example (``new_per_minute_max=60``, ``owned_max=100``)::

    q = SubjectQuotas(SubjectQuota(60, 100))
    q.admit("t", 80, now_ms=0)      # -> granted 60: the bucket holds a minute's worth
    q.admit("t", 1, now_ms=500)     # -> granted 0 (0.5 tokens): limit subjects_new_per_minute_max
    q.admit("t", 5, now_ms=5_000)   # -> granted 5 (one token a second)
    q.refund("t", 2)                # two of them existed already: t owns 63
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from cluster.errors import QuotaExceeded

MINUTE_MS = 60_000
BUCKETS_MAX = 4096  # principals' buckets kept before full ones (same as fresh) are dropped
NEW_PER_MINUTE_MAX_DEFAULT = 600  # a burst of 600 new subjects, then 10 a second
OWNED_MAX_DEFAULT = 2000          # a fifth of a real-time node's subjects_max (10,000)
RATE_SETTING = "subjects_new_per_minute_max"
OWNED_SETTING = "subjects_owned_max"


@dataclass(frozen=True, slots=True)
class SubjectQuota:
    new_per_minute_max: int
    owned_max: int | None  # None: no limit on subjects owned (the meta server counts only the rate)

    def __post_init__(self) -> None:
        if self.new_per_minute_max < 1 or (self.owned_max is not None and self.owned_max < 1):
            raise ValueError(f"subject quotas must be >= 1 (got {RATE_SETTING}={self.new_per_minute_max}, "
                             f"{OWNED_SETTING}={self.owned_max})")


@dataclass(frozen=True, slots=True)
class Admission:
    granted: int
    refusal: QuotaExceeded | None = None  # set when granted < asked


class SubjectQuotas:
    """See module docstring."""

    def __init__(self, quota: SubjectQuota, owned: Mapping[str, int] | None = None, *,
                 rate_setting: str = RATE_SETTING, owned_setting: str = OWNED_SETTING, where: str = "") -> None:
        self.quota = quota
        self.rate_setting = rate_setting
        self.owned_setting = owned_setting
        self.where = where                  # said in refusals: "on node X" / "at the meta server"
        self._owned: dict[str, int] = dict(owned or {})
        self._buckets: dict[str, tuple[float, int]] = {}  # principal -> (tokens, at_ms)

    def owned(self, principal: str) -> int:
        return self._owned.get(principal, 0)

    def tokens(self, principal: str, *, now_ms: int) -> float:
        cap = self.quota.new_per_minute_max
        tokens, at = self._buckets.get(principal, (float(cap), now_ms))
        return min(float(cap), tokens + max(0, now_ms - at) * cap / MINUTE_MS)

    def admit(self, principal: str, n: int, *, now_ms: int) -> Admission:
        if n < 0:
            raise ValueError(f"admit of {n} subjects")
        if n == 0:
            return Admission(0)
        tokens = self.tokens(principal, now_ms=now_ms)
        owned = self.owned(principal)
        by_rate = int(math.floor(tokens + 1e-9))
        by_owned = n if self.quota.owned_max is None else max(0, self.quota.owned_max - owned)
        granted = min(n, by_rate, by_owned)
        self._buckets[principal] = (tokens - granted, now_ms)
        self._owned[principal] = owned + granted
        if len(self._buckets) > BUCKETS_MAX:
            self._prune(now_ms)
        if granted == n:
            return Admission(n)
        return Admission(granted, self._refusal(principal, n, granted, by_rate <= by_owned, tokens - granted))

    def refund(self, principal: str, n: int) -> None:
        """``n`` subjects admitted for ``principal`` were not created after all."""
        if n <= 0:
            return
        cap = self.quota.new_per_minute_max
        tokens, at = self._buckets.get(principal, (float(cap), 0))
        self._buckets[principal] = (min(float(cap), tokens + n), at)
        self._owned[principal] = max(0, self.owned(principal) - n)

    def _refusal(self, principal: str, asked: int, granted: int, by_rate: bool, left: float) -> QuotaExceeded:
        where = f" {self.where}" if self.where else ""
        if by_rate:
            per = self.quota.new_per_minute_max
            wait_ms = math.ceil((1 - left) * MINUTE_MS / per) if left < 1 else 0
            return QuotaExceeded(f"{principal!r} may create {per} new subjects per minute{where} "
                                 f"({self.rate_setting}={per}); {asked - granted} of {asked} refused, the next may "
                                 f"be created in {wait_ms} ms", self.rate_setting, principal)
        return QuotaExceeded(f"{principal!r} owns {self.owned(principal)} subjects{where} "
                             f"({self.owned_setting}={self.quota.owned_max}); {asked - granted} of {asked} new "
                             f"subjects refused", self.owned_setting, principal)

    def _prune(self, now_ms: int) -> None:
        cap = float(self.quota.new_per_minute_max)
        for p in [p for p in self._buckets if self.tokens(p, now_ms=now_ms) >= cap]:
            del self._buckets[p]
