"""The console's pure parts (issue 31): page models from status rows and lookups, the
schedule's bucketing, viewer sessions and their CSRF tokens, and the app's refusals
(in process, through Starlette's test client: no socket, no cluster)."""

from __future__ import annotations

import re

import pytest

from cluster.console import views
from cluster.console.sessions import Sessions, csrf_ok

NOW = 1_800_000_000_000  # a whole hour: 1_800_000_000_000 % 3_600_000 == 0
MIN, HOUR = views.MINUTE_MS, views.HOUR_MS


# ---------------------------------------------------------------------- trace


def _states(status: str) -> dict[str, str]:
    hops = views.trace({"id": "a", "status": status, "seq": 7, "deliver_at_ms": NOW - 5, "subject": "s"}, NOW)
    assert [h.name for h in hops] == list(views.HOPS)  # every hop, always in order
    return {h.name: h.state for h in hops}


def test_a_dispatched_message_shows_accepted_filed_fired_stored_done_in_order():
    s = _states("dispatched")
    assert [h for h in views.HOPS if s[h] == "done"] == ["accepted", "filed", "fired", "stored at the real-time node"]
    assert s["cancelled"] == "skipped"
    assert s["delivered"] == "unknown"  # no real-time answer in the dict: said, not guessed (tests/test_trace_rules.py)


def test_a_pending_message_is_filed_and_cancellable_and_nothing_later_is_done():
    s = _states("pending")
    assert s["accepted"] == s["filed"] == "done" and s["fired"] == "waiting" and s["cancelled"] == "waiting"
    assert views.cancellable({"status": "pending"})
    assert not any(views.cancellable({"status": st}) for st in ("in_flight", "dispatched", "cancelled", ""))


def test_a_cancelled_message_skips_every_hop_after_filing():
    s = _states("cancelled")
    assert s["cancelled"] == "done"
    assert all(s[h] == "skipped" for h in ("fired", "stored at the real-time node", "delivered"))


def test_the_trace_says_when_it_was_accepted_and_the_time_it_fires_under():
    hops = {h.name: h for h in views.trace({"status": "dispatched", "seq": 9, "deliver_at_ms": NOW - 60_000,
                                              "accepted_ms": NOW - 120_000, "effective_ms": NOW - 30_000,
                                              "store_epoch": 3, "group": "delay-g1"}, NOW)}
    assert hops["accepted"].detail == f"by delay-g1 (store epoch 3), seq 9, at {views.iso(NOW - 120_000)}"
    assert hops["filed"].detail.endswith(f"filed under {views.iso(NOW - 30_000)}")  # behind the floor: later
    assert hops["fired"].detail == f"at its due time {views.iso(NOW - 30_000)}"
    cancelled = {h.name: h for h in views.trace({"status": "cancelled", "cancelled_ms": NOW}, NOW)}
    assert cancelled["cancelled"].detail == f"at {views.iso(NOW)}"


def test_trace_lines_name_the_message_and_mark_each_hop():
    lines = views.trace_lines({"id": "x1", "status": "in_flight", "seq": 1, "deliver_at_ms": NOW, "subject": "s"},
                              NOW)
    assert lines[0].startswith("message x1  status=in_flight") and len(lines) == 1 + len(views.HOPS)
    assert lines[3].startswith("  [x] fired") and lines[4].startswith("  [ ] stored")


# ---------------------------------------------------------------------- schedule


def test_a_burst_ten_minutes_ahead_lands_in_its_minute_with_minute_buckets():
    due = NOW + 10 * MIN + 17_000
    by_group = {"delay-1": ({due - due % MIN: 25}, MIN), "delay-2": ({due - due % MIN: 5}, MIN)}
    minute, hours, days = views.schedule_views(by_group, NOW + 3_000)
    assert minute.resolution_ms == MIN and len(minute.rows) == 60
    hit = [r for r in minute.rows if r.total]
    assert [(r.start_ms, r.total, r.counts) for r in hit] == [(NOW + 10 * MIN, 30, {"delay-1": 25, "delay-2": 5})]
    assert [r.total for r in hours.rows if r.total] == [30] and hours.rows[0].total == 30
    assert days.rows[0].total == 30 and len(days.rows) == 731


def test_hour_buckets_are_shown_as_hours_never_spread_over_minutes():
    by_group = {"d": ({NOW: 12, NOW + 3 * HOUR: 4}, HOUR)}
    minute = views.schedule_view("m", MIN, 60, by_group, NOW + 10 * MIN)
    assert minute.resolution_ms == HOUR and [r.total for r in minute.rows] == [12]
    hours = views.schedule_view("h", HOUR, 48, by_group, NOW + 10 * MIN)
    assert [(r.start_ms, r.total) for r in hours.rows if r.total] == [(NOW, 12), (NOW + 3 * HOUR, 4)]


def test_overdue_buckets_count_in_the_first_slot_and_far_ones_are_left_out():
    view = views.schedule_view("h", HOUR, 48, {"d": ({NOW - 5 * HOUR: 3, NOW + 49 * HOUR: 9}, HOUR)}, NOW)
    assert view.rows[0].total == 3 and sum(r.total for r in view.rows) == 3


def test_pending_buckets_reads_a_status_row_or_says_none():
    assert views.pending_buckets({"pending": 3}) is None
    assert views.pending_buckets({"pending_by_bucket": {str(NOW): 3, str(NOW + HOUR): 0}, "bucket_ms": HOUR}) \
        == ({NOW: 3}, HOUR)
    assert views.pending_buckets({"pending_by_bucket": {"x": 1}}) is None


def test_hour_buckets_with_minute_counts_show_the_minute_view_by_minute():
    due = NOW + 10 * MIN + 17_000
    by_group = {"d": ({NOW: 20, NOW + HOUR: 6, NOW + 5 * HOUR: 4}, HOUR), "e": ({NOW: 2}, HOUR)}
    minutes = {"d": {NOW + 10 * MIN: 18, NOW + 2 * MIN: 2, NOW + HOUR + 30 * MIN: 6}, "e": {NOW + 5 * MIN: 2}}
    minute, hours, _ = views.schedule_views(by_group, NOW + 3_000, minutes)
    assert minute.resolution_ms == MIN
    assert [(r.start_ms, r.total) for r in minute.rows if r.total] == \
        [(NOW + 2 * MIN, 2), (NOW + 5 * MIN, 2), (due - due % MIN, 18)]  # the next hour's bucket: past the view
    assert hours.resolution_ms == HOUR  # the hour and day views use the buckets
    assert [(r.start_ms, r.total) for r in hours.rows if r.total] == [(NOW, 22), (NOW + HOUR, 6), (NOW + 5 * HOUR, 4)]


def test_minute_counts_of_a_status_row_and_the_lateness_text():
    assert views.pending_minutes({}) is None
    assert views.pending_minutes({"pending_by_minute": {str(NOW): 2, str(NOW + MIN): 0}}) == {NOW: 2}
    assert views.lateness_text({}) == "not reported"
    assert views.lateness_text({"lateness": {"count": 0, "window_ms": HOUR}}) == "nothing fired in the last 60 min"
    assert views.lateness_text({"lateness": {"count": 9, "window_ms": HOUR, "p50_ms": 3, "p99_ms": 41}}) \
        == "p50 3 ms, p99 41 ms (9 fired in the last 60 min)"


# ---------------------------------------------------------------------- cluster


def test_cluster_groups_put_delay_first_masters_first_and_tell_health():
    rows = [
        {"role": "realtime", "group": "rt", "node_id": "r1", "address": "a:1", "epoch": 1},
        {"role": "delay", "group": "dg", "node_id": "d2", "address": "a:3", "mode": "slave", "election_epoch": 4,
         "replication_lag_bytes": 10, "replication_lag_ms": 20},
        {"role": "delay", "group": "dg", "node_id": "d1", "address": "a:2", "mode": "master", "election_epoch": 4,
         "pending": 5, "scrub": {"unrepaired": {}}},
        {"role": "delay", "group": "dg2", "node_id": "d3", "address": "a:4", "error": "UNAVAILABLE: down"},
    ]
    groups = views.cluster_groups(rows)
    assert [(g.role, g.group) for g in groups] == [("delay", "dg"), ("delay", "dg2"), ("realtime", "rt")]
    dg = groups[0]
    assert [m.node_id for m in dg.members] == ["d1", "d2"] and dg.healthy
    assert dg.members[1].lag == "10 B / 20 ms" and dg.members[0].epoch == "4" and dg.members[0].pending == "5"
    assert dg.members[1].pending == dg.members[1].dispatch_lag_ms == ""  # a slave dispatches nothing
    assert not groups[1].healthy and groups[1].members[0].mode == "unreachable"
    assert groups[0].members[0].disk == "not reported"


def test_disk_and_master_changes_come_from_the_status_when_reported():
    m = views.member({"role": "delay", "disk": {"used_bytes": 3 << 20, "free_bytes": 10 << 20}, "master_changes_1h": 2})
    assert (m.disk, m.master_changes) == ("3.0 MiB used / 10.0 MiB free", "2")
    fresh = views.member({"role": "realtime", "disk": {"used_bytes": None, "free_bytes": 1 << 20}})
    assert fresh.disk == "measuring / 1.0 MiB free"  # before the first retention pass sized the files


def test_an_unrepaired_segment_makes_a_member_unhealthy():
    m = views.member({"role": "delay", "scrub": {"unrepaired": {"seg": "crc"}}})
    assert not m.healthy and "unrepaired" in m.health


# ---------------------------------------------------------------------- sessions


def test_sessions_expire_when_idle_and_the_oldest_goes_beyond_the_maximum():
    s = Sessions(sessions_max=2, idle_ms_max=1000)
    a = s.create(0, "tok-a")
    b = s.create(10)
    assert s.get(a.sid, 500) is a  # touching a keeps it, b is now the least recently used
    s.create(600)
    assert s.get(b.sid, 600) is None and s.get(a.sid, 600) is a
    assert s.get(a.sid, 1700) is None and len(s) == 1


def test_csrf_needs_the_sessions_own_token():
    s = Sessions()
    a, b = s.create(0), s.create(0)
    assert csrf_ok(a, a.csrf) and not csrf_ok(a, b.csrf) and not csrf_ok(a, "") and not csrf_ok(None, a.csrf)


# ---------------------------------------------------------------------- the app, in process


@pytest.fixture
def client():
    from starlette.testclient import TestClient

    from cluster.console.app import create_app
    from cluster.console.backend import ConsoleCluster
    from cluster.security import SecuritySettings

    # no meta server listens on port 9: pages that need the cluster are not asked for here
    return TestClient(create_app(ConsoleCluster(("127.0.0.1:9",), SecuritySettings())))


def test_a_post_without_the_csrf_token_is_refused_and_does_nothing(client):
    r = client.post("/message/cancel", data={"id": "x"}, follow_redirects=False)
    assert r.status_code == 403 and "CSRF" in r.text
    r = client.post("/dead-letters", data={"action": "purge", "pick": "x", "csrf": "wrong"}, follow_redirects=False)
    assert r.status_code == 403


def test_every_page_of_an_open_cluster_says_so_and_sends_the_security_headers(client):
    r = client.get("/login")
    assert r.status_code == 200 and 'id="open-banner"' in r.text
    csp = r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY" and "frame-ancestors 'none'" in csp
    assert "script-src 'self';" in csp and "unsafe-inline" not in csp.split("script-src", 1)[1].split(";")[0]
    assert "<script>" not in r.text and not re.search(r"\son[a-z]+=", r.text)  # no inline script, no handlers
    assert client.get("/static/console.js").status_code == 200
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie


def test_a_secure_cluster_sends_a_viewer_without_a_token_to_the_login_page(tmp_path):
    from starlette.testclient import TestClient

    from cluster.console.app import create_app
    from cluster.console.backend import ConsoleCluster
    from cluster.security import SecuritySettings

    files = {k: tmp_path / k for k in ("ca", "cert", "key")}
    for p in files.values():
        p.write_text("-")
    settings = SecuritySettings(tls_ca_file=files["ca"], tls_cert_file=files["cert"], tls_key_file=files["key"])
    c = TestClient(create_app(ConsoleCluster(("127.0.0.1:9",), settings), https=True), base_url="https://testserver")
    for page in ("/", "/schedule", "/message?id=x", "/dead-letters"):
        r = c.get(page, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/login")
    r = c.get("/login")
    assert 'id="open-banner"' not in r.text and "secure" in r.headers["set-cookie"].lower()
    assert c.post("/message/cancel", data={"id": "x"}, follow_redirects=False).status_code == 303  # to login


def test_node_flow_rates_come_from_the_previous_sample_of_the_same_node():
    row = {"node_id": "r1", "group": "rt", "subjects": ["b", "a"], "now_ms": 12_000,
           "counters": {"appended": 50, "delivered": 30, "acked": 10, "redelivered": 2}}
    first = views.node_flow(row, None)
    assert (first.in_per_s, first.subjects, first.delivered, first.redelivered) == ("-", ["a", "b"], 30, 2)
    later = views.node_flow(row, (10_000, {"appended": 10, "delivered": 30, "acked": 0}))
    assert (later.in_per_s, later.out_per_s, later.acked_per_s) == ("20.0", "0.0", "5.0")


def test_consumer_rows_come_from_a_realtime_status_or_say_none():
    assert views.consumer_rows({"group": "rt"}) is None
    got = views.consumer_rows({"group": "rt", "groups": [
        {"subject": "a", "group": "g", "backlog": 3, "lag_messages": 5, "in_flight": 2, "redelivered": 1},
        {"subject": "broken"}]})
    assert got == [views.ConsumerRow("rt", "a", "g", 3, 5, 2, 1, False)]


def test_the_console_refuses_to_dial_with_a_node_certificate(tmp_path):
    from cluster import certs
    from cluster.console.backend import node_certificate
    from cluster.security import SecuritySettings

    ca_cert, _ = certs.make_ca(tmp_path / "ca")
    node_cert, node_key = certs.issue(tmp_path / "ca", tmp_path, "n1", kind="node", stem="node")
    client_cert, client_key = certs.issue(tmp_path / "ca", tmp_path, "viewer", kind="client", hosts=(), stem="client")

    def settings(cert, key):
        return SecuritySettings(tls_ca_file=ca_cert, tls_cert_file=cert, tls_key_file=key)
    assert node_certificate(settings(node_cert, node_key)) == "node:n1"
    assert node_certificate(settings(client_cert, client_key)) is None
    assert node_certificate(SecuritySettings()) is None


def test_after_login_the_console_sends_viewers_only_to_its_own_pages():
    from cluster.console.app import local_path

    assert local_path("/message?id=a%2Fb") and local_path("/")
    for away in ("//evil.example/", "/\\evil.example", "https://evil.example/", "evil", "/a\\b", "/a\nb", ""):
        assert not local_path(away), away


def test_a_flood_of_new_visitors_logs_no_one_out(tmp_path, monkeypatch):
    from starlette.testclient import TestClient

    from cluster.console import app as console_app
    from cluster.console.backend import ConsoleCluster
    from cluster.security import SecuritySettings

    monkeypatch.setattr(console_app, "GUESTS_MAX", 3)
    files = {k: tmp_path / k for k in ("ca", "cert", "key")}
    for p in files.values():
        p.write_text("-")
    settings = SecuritySettings(tls_ca_file=files["ca"], tls_cert_file=files["cert"], tls_key_file=files["key"])
    web = console_app.create_app(ConsoleCluster(("127.0.0.1:9",), settings), https=True)
    viewer = TestClient(web, base_url="https://testserver")
    viewer.get("/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', viewer.get("/login").text).group(1)

    async def valid(self):  # the meta servers would accept this token
        return {}
    monkeypatch.setattr("cluster.discovery.MetaResolver.load", valid)
    r = viewer.post("/login", data={"csrf": csrf, "token": "hgt_good", "next": "/login"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    for _ in range(10):  # new visitors, each a guest session
        TestClient(web, base_url="https://testserver").get("/login")
    assert "Log out" in viewer.get("/login").text, "the logged-in viewer kept the session"


def test_master_changes_in_the_last_hour_come_from_the_epochs_seen():
    h = views.EpochHistory(sample_ms=1000)
    assert h.changes("d", NOW) is None
    h.record("d", 3, NOW)                      # 10:00 epoch 3
    h.record("d", 4, NOW + 40 * MIN)           # 10:40
    assert h.changes("d", NOW + 40 * MIN) == (1, NOW)  # watched 40 min only: since the first look
    assert views.master_changes_text(h.changes("d", NOW + 40 * MIN), NOW + 40 * MIN).endswith("(first look)")
    h.record("d", 6, NOW + 65 * MIN)           # 11:05
    assert h.changes("d", NOW + 70 * MIN) == (3, NOW + 10 * MIN)  # 6 - 3, the sample at the window's edge kept
    assert views.master_changes_text(h.changes("d", NOW + 70 * MIN), NOW + 70 * MIN) == "3"
    h.record("d", 6, NOW + 170 * MIN)          # nothing for 100 minutes: the samples before the edge go
    assert h.changes("d", NOW + 170 * MIN) == (0, NOW + 110 * MIN)


def test_the_cluster_page_counts_a_new_master_of_a_group():
    h = views.EpochHistory(sample_ms=1)
    row = {"role": "delay", "group": "g", "node_id": "a", "mode": "master", "election_epoch": 2}
    views.cluster_groups([row], h, NOW)
    (g,) = views.cluster_groups([row | {"node_id": "b", "election_epoch": 3}], h, NOW + 5000)
    assert g.members[0].master_changes.startswith("1 since")


# ---------------------------------------------------------------------- schedule per subject


def _delay_row(asked: str) -> dict:
    row = {"role": "delay", "group": "delay-g1", "address": "a:1", "mode": "master", "pending": 12,
           "bucket_ms": HOUR, "pending_by_bucket": {str(NOW): 9, str(NOW + HOUR): 3},
           "pending_by_minute": {str(NOW + 10 * MIN): 9},
           "pending_subjects": {"orders": 8, "mail": 3, views.OTHER_SUBJECTS: 1}}
    if asked:
        row["pending_by_subject"] = {asked: {str(NOW + HOUR): 3} if asked == "mail" else {}}
    return row


def test_subject_totals_sum_the_masters_and_keep_other_apart():
    rows = [_delay_row(""), _delay_row("") | {"group": "delay-g2", "pending_subjects": {"mail": 2}}]
    assert views.subject_totals(rows) == ({"orders": 8, "mail": 5}, 1)
    assert views.subject_buckets(_delay_row("mail"), "mail") == {NOW + HOUR: 3}
    assert views.subject_buckets(_delay_row(""), "mail") is None  # a Status that did not ask


def test_the_schedule_page_shows_a_chosen_subject_in_its_buckets(client, monkeypatch):
    from cluster.console import backend

    asked: list[str] = []

    async def rows(self, subject=""):
        asked.append(subject)
        return [_delay_row(subject), {"role": "realtime", "group": "realtime-1", "address": "b:1"}]
    monkeypatch.setattr(backend.Viewer, "status_rows", rows)
    monkeypatch.setattr("cluster.console.app._now_ms", lambda: NOW + 5 * MIN)
    page = client.get("/schedule").text
    assert '<option value="orders">orders (8 pending)</option>' in page and "subject-shown" not in page
    r = client.get("/schedule", params={"subject": "mail"})
    assert asked == ["", "mail"] and 'id="subject-shown"' in r.text
    assert '<option value="mail" selected>' in r.text
    slots = re.findall(r'<tr class="slot" data-start="(\d+)"><td>[^<]*</td><td class="count">(\d+)</td>', r.text)
    day = NOW + HOUR - (NOW + HOUR) % (24 * HOUR)
    assert set(slots) == {(str(NOW + HOUR), "3"), (str(day), "3")}, slots  # its one bucket: its hour, its day
    assert re.search(r'<td class="count">3</td>', r.text.split('id="totals"')[1].split("</table>")[0])
    bad = client.get("/schedule", params={"subject": "no spaces allowed"})
    assert asked[-1] == "" and "no spaces allowed" in bad.text and 'id="subject-shown"' not in bad.text


def test_the_minute_view_of_one_subject_shows_its_minutes_from_the_node():
    """A subject's counts per minute (``pending_by_subject_minute``) place its burst in its
    minute row of the minute view, not at its bucket's start; a node without them: the bucket."""
    row = _delay_row("mail")
    row["pending_by_subject"]["mail"] = {str(NOW): 2, str(NOW + HOUR): 3}
    row["pending_by_subject_minute"] = {"mail": {str(NOW + 10 * MIN): 2}}
    assert views.subject_minutes(row, "mail") == {NOW + 10 * MIN: 2}
    assert views.subject_minutes(_delay_row("mail"), "mail") is None
    by_group = {"delay-g1": (views.subject_buckets(row, "mail"), HOUR)}
    minute_view = views.schedule_views(by_group, NOW + 5 * MIN, {"delay-g1": views.subject_minutes(row, "mail")})[0]
    got = {r.start_ms: r.total for r in minute_view.rows if r.total}
    assert minute_view.resolution_ms == MIN and got == {NOW + 10 * MIN: 2, NOW + HOUR: 3}
