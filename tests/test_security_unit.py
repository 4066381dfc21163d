"""The pure parts of cluster/security.py: grants, the token table, settings, file reloads."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster import certs
from cluster.errors import InvalidArgument
from cluster.security import (Action, AuthTable, Grant, Principal, Refused, SecuritySettings, TlsFiles, _bearer,
                              _CALLER, check, load_settings, token_digest)



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


@given(st.text(min_size=1, max_size=30), st.text(max_size=30))
def test_a_grant_for_one_subject_covers_that_subject_only(subject, other):
    p = Principal("t", grants=[Grant(action="produce", subjects=[subject.replace("*", "").replace("?", "")
                                                                 .replace("[", "") or "x"])])
    allowed = p.grants[0].subjects[0]
    assert p.may(Action.PRODUCE, allowed)
    assert p.may(Action.PRODUCE, other) == (other == allowed)


def test_check_refuses_node_methods_to_tokens_whatever_their_grants():
    token = _CALLER.set(Principal("t", grants=[Grant(action="node")]))
    try:
        with pytest.raises(Refused, match="may not node"):
            check(Action.NODE)
        with pytest.raises(Refused, match="may not produce subject 'a'"):
            check(Action.PRODUCE, ["a"])
    finally:
        _CALLER.reset(token)
    check(Action.NODE)  # security off (no caller): allowed


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
