"""The pure parts of cluster/security.py: grants, the token table, settings, file reloads."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster import certs
from cluster import errors as E
from cluster.codec import SUBJECT_RE
from cluster.errors import InvalidArgument
from cluster.auththrottle import FailureThrottle, peer_key
from cluster.security import (METHOD_ACTIONS, Action, Authenticator, AuthTable, Grant, Principal, SecuritySettings,
                              TlsFiles, _bearer, _CALLER, check, load_settings, token_digest)



def test_grants_match_subject_patterns_and_groups():
    p = Principal("orders", grants=[Grant(action="produce", subjects=["orders.*"]),
                                    Grant(action="consume", subjects=["orders.*", "audit"], groups=["billing"])])
    assert p.may(Action.PRODUCE, "orders.created")
    assert not p.may(Action.PRODUCE, "payments.created")
    assert not p.may(Action.PRODUCE, "orders")             # "orders.*" needs the dot
    assert p.may(Action.CONSUME, "audit", "billing")
    assert not p.may(Action.CONSUME, "audit", "shipping")
    assert not p.may(Action.CANCEL, "orders.created")
    assert not p.may(Action.ADMIN)
    assert p.may(Action.DISCOVER)
    assert Principal("node:n1", node=True).may(Action.NODE)


SUBJECTS = st.from_regex(SUBJECT_RE, fullmatch=True).filter(lambda s: len(s) <= 200)


@given(SUBJECTS, st.text(max_size=30))
def test_a_grant_for_one_subject_covers_that_subject_only(allowed, other):
    p = Principal("t", grants=[Grant(action="produce", subjects=[allowed])])
    assert p.may(Action.PRODUCE, allowed)
    assert p.may(Action.PRODUCE, other) == (other == allowed)


@pytest.mark.parametrize("subject", ["orders.a\n", "orders.a\n../x", "orders./x", "orders.é", "orders. x", ""])
def test_a_subject_outside_the_subject_rule_is_never_granted_even_by_a_star(subject):
    """fnmatch's "*" matches newlines and slashes: the subject rule keeps them out of every grant."""
    p = Principal("t", grants=[Grant(action="produce", subjects=["*"]), Grant(action="produce", subjects=["orders.*"]),
                               Grant(action="consume", subjects=["*"], groups=["*"])])
    assert not p.may(Action.PRODUCE, subject)
    assert not p.may(Action.CONSUME, "orders.a", subject or "g\n")  # a group name follows the rule too
    assert p.may(Action.PRODUCE, "orders.a") and p.may(Action.CONSUME, "orders.a", "g")


def test_check_refuses_node_methods_to_tokens_whatever_their_grants():
    token = _CALLER.set(Principal("t", grants=[Grant(action="node")]))
    try:
        with pytest.raises(E.PermissionDenied, match="may not node"):
            check(Action.NODE)
        with pytest.raises(E.PermissionDenied, match="may not produce subject 'a'"):
            check(Action.PRODUCE, ["a"])
    finally:
        _CALLER.reset(token)
    check(Action.NODE)  # security off (no caller): allowed


def test_naming_no_subject_needs_a_grant_all_the_same():
    """An empty Ack names no subject: the caller needs a consume grant (for that group) anyway."""
    token = _CALLER.set(Principal("producer", grants=[Grant(action="produce", subjects=["orders.*"])]))
    try:
        with pytest.raises(E.PermissionDenied, match="may not consume in group 'billing'"):
            check(Action.CONSUME, [], "billing")
        with pytest.raises(E.PermissionDenied, match="may not consume in group 'billing'"):
            check(Action.CONSUME, set(), "billing")
        check(Action.PRODUCE, [])  # a produce grant on some subject
    finally:
        _CALLER.reset(token)
    token = _CALLER.set(Principal("reader", grants=[Grant(action="consume", subjects=["orders.*"],
                                                          groups=["billing"])]))
    try:
        check(Action.CONSUME, [], "billing")
        with pytest.raises(E.PermissionDenied):
            check(Action.CONSUME, [], "shipping")
    finally:
        _CALLER.reset(token)


def test_route_needs_produce_or_consume_on_that_very_subject():
    token = _CALLER.set(Principal("t", grants=[Grant(action="consume", subjects=["orders.*"], groups=["g"]),
                                               Grant(action="cancel", subjects=["payments.*"])]))
    either = (Action.PRODUCE, Action.CONSUME)
    try:
        check(either, ["orders.x"])
        with pytest.raises(E.PermissionDenied, match="may not produce or consume subject 'payments.x'"):
            check(either, ["payments.x"])  # cancel is no reason to route
    finally:
        _CALLER.reset(token)


class _Context:
    """What the interceptor reads of a call's context."""

    def __init__(self, peer: str, token: str | None, cn: str = "client:c") -> None:
        self._peer, self._token, self._cn = peer, token, cn

    def auth_context(self):
        return {"x509_common_name": [self._cn.encode()]}

    def peer(self):
        return self._peer

    def invocation_metadata(self):
        return [("authorization", f"Bearer {self._token}")] if self._token is not None else []


def _auth(tmp_path, **throttle):
    auth = tmp_path / "auth.json"
    good = certs.add_token(auth, "p", [Grant(action="produce", subjects=["orders.*"])])
    clock = [0]
    return Authenticator(AuthTable(auth), FailureThrottle(**throttle), clock=lambda: clock[0]), good, clock


def test_every_method_is_allowed_only_with_a_grant_of_one_of_its_actions(tmp_path):
    a, good, _ = _auth(tmp_path)
    ctx = _Context("ipv4:127.0.0.1:1", good)
    for method, need in METHOD_ACTIONS.items():
        if Action.PRODUCE in need or Action.DISCOVER in need:
            assert a.authorize(method, ctx).name == "p", method
        else:
            with pytest.raises(E.PermissionDenied):
                a.authorize(method, ctx)
    with pytest.raises(E.PermissionDenied, match="needs a node certificate"):
        a.authorize("/hourglass.v1.Something/New", ctx)  # not listed: nodes only
    with pytest.raises(E.PermissionDenied, match=r"'p' may not consume \(Ack needs consume\)"):
        a.authorize("/hourglass.v1.Consumer/Ack", ctx)
    node = _Context("ipv4:127.0.0.1:1", None, cn="node:n1")
    assert all(a.authorize(m, node).node for m in METHOD_ACTIONS)


def test_the_throttle_refuses_a_peer_after_its_failures_until_the_window_passes():
    t = FailureThrottle(failures_max=3, window_ms=10_000, peers_max=100)
    assert [t.failed("a", ms) for ms in (0, 1000, 2000)] == [False, False, True]
    assert t.retry_after_ms("a", 2000) == 8000 and t.retry_after_ms("a", 9999) == 1
    assert t.retry_after_ms("b", 2000) == 0  # another peer: untouched
    assert t.retry_after_ms("a", 10_000) == 0  # the failure at 0 left the window
    assert t.failed("a", 10_500)  # the last three: 1000, 2000, 10_500
    assert t.retry_after_ms("a", 10_999) == 1 and t.retry_after_ms("a", 11_000) == 0
    assert t.retry_after_ms("a", 30_000) == 0 and len(t) == 0  # all failures old: the peer is forgotten


def test_failures_spread_wider_than_the_window_never_refuse():
    t = FailureThrottle(failures_max=3, window_ms=1000, peers_max=10)
    for ms in range(0, 100_000, 500):  # 2 a second: never 3 within one second
        assert t.retry_after_ms("a", ms) == 0
        assert not t.failed("a", ms)


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 50)), max_size=200))
def test_the_throttle_against_a_model(events):
    """Refused exactly when the peer's last failures_max failures lie within the window, and
    then until the oldest of them leaves it."""
    t = FailureThrottle(failures_max=3, window_ms=100, peers_max=100)
    model: dict[str, list[int]] = {}
    now = 0
    for peer, step in events:
        now += step
        last = model.get(peer, [])[-3:]
        wait = last[0] + 100 - now if len(last) == 3 and now - last[0] < 100 else 0
        assert t.retry_after_ms(peer, now) == wait
        if not wait:  # a refused attempt is not looked at: it counts for nothing
            model.setdefault(peer, []).append(now)
            t.failed(peer, now)


def test_the_throttle_remembers_at_most_peers_max_peers():
    t = FailureThrottle(failures_max=2, window_ms=1000, peers_max=4)
    for i in range(10):
        t.failed(f"p{i}", 0)
        t.failed(f"p{i}", 1)
        assert len(t) <= 4
    assert [p for p in map("p{}".format, range(10)) if t.retry_after_ms(p, 2)] == ["p6", "p7", "p8", "p9"]


def test_peers_are_counted_by_address_without_the_port():
    assert peer_key("ipv4:10.0.0.5:41000") == "10.0.0.5"
    assert peer_key("ipv6:[2001:db8::1]:41000") == "2001:db8::/64"
    assert peer_key("ipv6:[2001:db8::ffff:1]:5") == peer_key("ipv6:[2001:db8::2]:6")  # one /64, one peer
    assert peer_key("unix:/tmp/s") == "unix"
    assert peer_key("") == "unknown"


def test_a_throttled_peer_is_refused_unread_and_others_and_nodes_are_not(tmp_path, monkeypatch):
    a, good, clock = _auth(tmp_path, failures_max=3, window_ms=10_000, peers_max=100)
    method = "/hourglass.v1.Producer/SendBatch"
    looked = []
    real = a.table.principal
    monkeypatch.setattr(a.table, "principal", lambda t: looked.append(t) or real(t))
    bad = _Context("ipv4:10.0.0.9:1", "hgt_wrong")
    for _ in range(3):
        with pytest.raises(E.Unauthenticated, match="unknown token"):
            a.authorize(method, bad)
    assert len(looked) == 3
    clock[0] = 4000
    with pytest.raises(E.Unauthenticated, match=r"too many failed authentications from 10\.0\.0\.9 .*try again in 6 s"):
        a.authorize(method, _Context("ipv4:10.0.0.9:2", good))  # the right token, refused unread
    assert len(looked) == 3
    assert a.authorize(method, _Context("ipv4:10.0.0.8:1", good)).name == "p"  # another address
    assert a.authorize(method, _Context("ipv4:10.0.0.9:3", None, cn="node:n1")).node  # a node is not throttled
    clock[0] = 10_000
    assert a.authorize(method, _Context("ipv4:10.0.0.9:4", good)).name == "p"  # the window passed
    # a missing token counts as a failed authentication too
    for _ in range(3):
        with pytest.raises(E.Unauthenticated, match="no bearer token"):
            a.authorize(method, _Context("ipv4:10.0.0.7:1", None))
    with pytest.raises(E.Unauthenticated, match="too many"):
        a.authorize(method, _Context("ipv4:10.0.0.7:1", good))


def test_throttle_settings_have_names_and_bounds(monkeypatch):
    s = load_settings()
    assert (s.auth_failures_max, s.auth_failures_window_ms, s.auth_throttle_peers_max) == (20, 10_000, 10_000)
    monkeypatch.setenv("HOURGLASS_AUTH_FAILURES_MAX", "0")
    with pytest.raises(InvalidArgument, match="greater than or equal to 1"):
        load_settings()


def test_tokens_are_stored_hashed_and_found_by_digest(tmp_path):
    auth = tmp_path / "auth.json"
    t1 = certs.add_token(auth, "a", [Grant(action="produce")])
    t2 = certs.add_token(auth, "b", [Grant(action="consume")], tmp_path / "b.token")
    text = auth.read_text()
    assert t1 not in text and t2 not in text and token_digest(t1) in text
    assert oct(auth.stat().st_mode & 0o777) == "0o600"
    assert (tmp_path / "b.token").read_text().strip() == t2
    table = AuthTable(auth)
    assert table.principal(t1).name == "a" and table.principal(t2).name == "b"
    assert table.principal("hgt_wrong") is None and table.principal("") is None


def test_the_auth_file_is_read_again_when_it_changes_and_a_bad_one_is_ignored(tmp_path):
    auth = tmp_path / "auth.json"
    t1 = certs.add_token(auth, "a", [Grant(action="produce")])
    table = AuthTable(auth, check_every_s=0)
    t2 = certs.add_token(auth, "b", [Grant(action="produce")])
    assert table.principal(t2).name == "b"
    auth.write_text("{not json")
    os.utime(auth, ns=(1, 1))
    assert table.principal(t1).name == "a"  # the tokens loaded stay
    with pytest.raises(InvalidArgument, match="auth file"):
        AuthTable(auth)


def test_the_auth_file_refuses_unknown_actions(tmp_path):
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"tokens": [{"name": "x", "sha256": "0" * 64, "allow": [{"action": "root"}]}]}))
    with pytest.raises(InvalidArgument, match="auth file"):
        AuthTable(auth)


def test_tls_settings_are_all_or_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HOURGLASS_TLS_CA_FILE", str(tmp_path / "ca.crt"))
    with pytest.raises(InvalidArgument, match="TLS needs all of"):
        load_settings()
    monkeypatch.delenv("HOURGLASS_TLS_CA_FILE")
    assert not load_settings().tls


def test_the_token_is_a_secret_in_settings(monkeypatch):
    monkeypatch.setenv("HOURGLASS_TOKEN", "hgt_s3cret")
    s = SecuritySettings()
    assert "hgt_s3cret" not in repr(s) and "hgt_s3cret" not in str(s.model_dump())
    assert s.read_token() == "hgt_s3cret"


def test_bearer_header_parsing():
    assert _bearer([("authorization", "Bearer abc")]) == "abc"
    assert _bearer([("authorization", "Basic abc")]) == ""
    assert _bearer([("authorization", "Bearer " + "x" * 5000)]) == ""
    assert _bearer([("x", "y")]) is None


def test_tls_files_are_read_again_when_they_change(tmp_path):
    certs.make_ca(tmp_path)
    crt, key = certs.issue(tmp_path, tmp_path, "n1", kind="node")
    files = TlsFiles(tmp_path / "ca.crt", crt, key, check_every_s=0)
    first = files.cert
    assert not files.refresh()
    certs.issue(tmp_path, tmp_path, "n1", kind="node")  # rotated in place
    assert files.refresh() and files.cert != first and files.generation == 2
    key.write_text("half written")
    assert not files.refresh() and files.generation == 2  # keeps the last good set
    with pytest.raises(InvalidArgument, match="cannot read TLS files"):
        TlsFiles(tmp_path / "ca.crt", crt, tmp_path / "missing.key")


def test_certificates_carry_the_role_in_their_common_name(tmp_path):
    from cryptography import x509

    certs.make_ca(tmp_path)
    for kind in ("node", "client"):
        crt, _ = certs.issue(tmp_path, tmp_path, "a", kind=kind)
        cn = x509.load_pem_x509_certificate(crt.read_bytes()).subject.rfc4514_string()
        assert cn == f"CN={kind}:a"


def test_an_auth_entry_names_a_token_or_a_certificate_never_both_nor_a_node(tmp_path):
    auth = tmp_path / "auth.json"
    certs.grant_certificate(auth, "orders", "client:orders", [Grant(action="produce", subjects=["orders.*"])])
    table = AuthTable(auth)
    assert table.by_certificate("client:orders").may(Action.PRODUCE, "orders.x")
    assert table.by_certificate("client:other") is None
    for entry in ({"name": "x", "allow": []}, {"name": "x", "sha256": "0" * 64, "certificate": "client:x"},
                  {"name": "x", "certificate": "node:n1"}):
        auth.write_text(json.dumps({"tokens": [entry]}))
        with pytest.raises(InvalidArgument, match="auth file"):
            AuthTable(auth)


def test_a_client_sends_a_rotated_token_from_the_next_dial(tmp_path):
    from cluster.security import ClientSecurity

    certs.make_ca(tmp_path)
    crt, key = certs.issue(tmp_path, tmp_path, "c", kind="client", hosts=())
    token_file = tmp_path / "t.token"
    token_file.write_text("hgt_one\n")
    sec = ClientSecurity(SecuritySettings(tls_ca_file=tmp_path / "ca.crt", tls_cert_file=crt, tls_key_file=key,
                                          token_file=token_file, reload_check_ms=10))
    gen = sec.generation()
    assert sec._token == "hgt_one"
    token_file.write_text("hgt_two_rotated\n")
    os.utime(token_file, ns=(2, 2))
    import time

    time.sleep(0.02)
    assert sec.generation() == gen + 1 and sec._token == "hgt_two_rotated"
    time.sleep(0.02)
    assert sec.generation() == gen + 1  # nothing changed since
