"""Failed authentications per peer address, and which peers are refused for a while: the
pure core of the failed-auth throttle (docs/security.md, "Failed-authentication throttle").
No clock, no I/O, no grpc: time comes in as ``now_ms``; ``cluster/security.py``'s
``Authenticator`` is the shell that reads the peer and the clock and refuses.

Invariants: at most ``peers_max`` peers and ``failures_max`` timestamps a peer are held; a
peer is refused exactly while its last ``failures_max`` failures all lie within the last
``window_ms``; nothing but a failure changes what is held (a refused attempt or a success
is not recorded).
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict, deque

AUTH_FAILURES_MAX = 20                # failed authentications a peer may make within the window ...
AUTH_FAILURES_WINDOW_MS = 10_000      # ... before it is refused unread until the window passes
AUTH_THROTTLE_PEERS_MAX = 10_000      # peers whose failures are remembered (least recently failed forgotten first)
IPV6_PEER_PREFIX = 64                 # an IPv6 caller counts as its /64 (one host may hold a whole /64)


def peer_key(peer: str) -> str:
    """The address a caller is counted by, from a grpc peer string: ``ipv4:10.0.0.5:41000`` ->
    ``10.0.0.5``; ``ipv6:[2001:db8::1]:41000`` -> ``2001:db8::/64`` (``IPV6_PEER_PREFIX``);
    ``unix:/path`` -> ``unix``; anything else as it is."""
    kind, _, rest = (peer or "").partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        host = rest.rpartition("]")[0].lstrip("[") if rest.startswith("[") else rest
        try:
            return str(ipaddress.ip_network(f"{host.split('%', 1)[0]}/{IPV6_PEER_PREFIX}", strict=False))
        except ValueError:
            return host
    if kind in ("unix", "unix-abstract"):
        return kind
    return peer or "unknown"


class FailureThrottle:
    """Failed authentications per peer, and who is refused for a while. Pure: time comes in
    as ``now_ms``; no clock, no I/O.

    A peer's last ``failures_max`` failures are kept. While the oldest of them is younger than
    ``window_ms`` (that is, ``failures_max`` failures within the window) the peer is refused
    without its credentials being looked at: no token is hashed, nothing is counted, so a
    guesser learns nothing and costs the server nothing. Successes are not recorded and clear
    nothing (a caller with one good token cannot wash another token's guesses away); a peer
    under the limit is not slowed at all. At most ``peers_max`` peers are remembered, the one
    that failed least recently forgotten first.

    Worked example (``failures_max=3, window_ms=10_000``): failures at 0, 1000 and 2000 ms ->
    refused; at 5000 ``retry_after_ms`` is 5000 (until 10_000, when the failure at 0 leaves
    the window); at 10_000 allowed; a failure at 10_500 -> the last three are 1000, 2000,
    10_500 -> refused again until 11_000.
    """

    def __init__(self, failures_max: int = AUTH_FAILURES_MAX, window_ms: int = AUTH_FAILURES_WINDOW_MS,
                 peers_max: int = AUTH_THROTTLE_PEERS_MAX) -> None:
        assert failures_max >= 1 and window_ms >= 1 and peers_max >= 1
        self.failures_max = failures_max
        self.window_ms = window_ms
        self.peers_max = peers_max
        self._failures: OrderedDict[str, deque[int]] = OrderedDict()  # least recently failed first

    def __len__(self) -> int:
        return len(self._failures)

    def retry_after_ms(self, peer: str, now_ms: int) -> int:
        """0 when ``peer`` may try now, else how long until it may."""
        times = self._failures.get(peer)
        if times is None:
            return 0
        if times[-1] <= now_ms - self.window_ms:  # every failure is out of the window: forget the peer
            del self._failures[peer]
            return 0
        if len(times) < self.failures_max:
            return 0
        return max(0, times[0] + self.window_ms - now_ms)

    def failed(self, peer: str, now_ms: int) -> bool:
        """Record a failure; True when it makes ``peer`` refused (it reached the limit)."""
        times = self._failures.get(peer)
        if times is None:
            times = self._failures[peer] = deque(maxlen=self.failures_max)
            while len(self._failures) > self.peers_max:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(peer)
        times.append(now_ms)
        return self.retry_after_ms(peer, now_ms) > 0
