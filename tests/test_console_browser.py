"""The web console in a headless Chromium against a real local cluster (issue 31): what
`hourglass dev up` starts (``LocalCluster(meta=True)``) and a `hourglass console` process
on it. Each page loads with real data (cluster, schedule, subjects, message, dead letters);
a message's trace after delivery; Cancel from the page (and `hourglass lookup` agrees); a
dead letter sent back from the page is delivered.
The screenshots in docs/console.md are taken here."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from cluster.client import Consumer, Producer
from cluster.devcluster import LocalCluster
from cluster.discovery import MetaResolver
from tests.helpers.console import ROOT, ConsoleProcess, browser_or_skip, shot, wait_for
from tests.helpers.flow import receive_ids

POLLS_MAX = 40
MAX_ATTEMPTS = 2  # the real-time nodes dead-letter a message at its second nack


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # the delay group as master + slave (election), as `dev up --replicas 2` makes it
    c = LocalCluster(tmp_path_factory.mktemp("console"), meta=True, n_delay=2, delay_replicas=2,
                     env={"HOURGLASS_MAX_ATTEMPTS": str(MAX_ATTEMPTS)})
    with c:
        c.wait_registered()
        asyncio.run(c.wait_master("delay"))
        yield c


@pytest.fixture(scope="module")
def console(cluster, tmp_path_factory):
    p = ConsoleProcess(["--meta", ",".join(cluster.meta_addresses)], tmp_path_factory.mktemp("console-log") / "log")
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def browser():
    d = browser_or_skip()
    try:
        yield d
    finally:
        d.quit()


def _resolver(c: LocalCluster) -> MetaResolver:
    return MetaResolver(c.meta_addresses, security=c.client_security())


def _css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


async def _send(c: LocalCluster, subject: str, ids: list[str], **when) -> None:
    r = _resolver(c)
    try:
        async with Producer(r) as p:
            res = await (await p.send_many(subject, [b"payload"] * len(ids), ids=ids, **when))
            assert not res.errors, res.errors
    finally:
        await r.close()


def test_the_cluster_page_lists_every_group_and_member_and_refreshes_itself(cluster, console, browser):
    browser.get(console.url + "/cluster")
    groups = {e.get_attribute("data-group") for e in _css(browser, "h3.group")}
    assert groups == {"delay-g1", "realtime-1"}
    modes = {e.get_attribute("data-node"): e.find_element("css selector", ".mode").text
             for e in _css(browser, "tr.member")}
    master = asyncio.run(cluster.wait_master("delay"))
    slave = ({"delay-1", "delay-2"} - {master}).pop()
    assert modes == {master: "master", slave: "slave", "realtime-1": "master"}
    lag = _css(browser, f'tr.member[data-node="{slave}"]')[0].text
    assert " B / " in lag and " ms" in lag, lag  # the slave's replication lag
    # each node reports its disk and its own master changes (read at once: the table refreshes itself)
    cells = {node: (disk, changes) for node, disk, changes in browser.execute_script(
        "return Array.from(document.querySelectorAll('tr.member')).map(r => [r.dataset.node, "
        "r.querySelector('.disk').textContent, r.querySelector('.master-changes').textContent])")}
    assert set(cells) == {master, slave, "realtime-1"}
    assert all("MiB free" in disk and changes.isdigit() for disk, changes in cells.values()), cells
    assert _css(browser, "#open-banner"), "an open cluster says so on every page"
    first = _css(browser, "#live")[0].get_attribute("data-now")
    wait_for(browser, lambda d: _css(d, "#live")[0].get_attribute("data-now") != first,
             "the cluster table refreshed itself")
    shot(browser, "cluster")


async def test_the_schedule_page_counts_a_burst_due_in_ten_minutes(cluster, console, browser):
    browser.get(console.url + "/schedule")
    before = int(_css(browser, 'tr.total[data-group="delay-g1"] .count')[0].text)
    await _send(cluster, "console.burst", [f"burst-{i}" for i in range(20)], delay_ms=10 * 60_000)
    browser.get(console.url + "/schedule")
    assert int(_css(browser, 'tr.total[data-group="delay-g1"] .count')[0].text) == before + 20
    shot(browser, "schedule")


async def test_the_schedule_chart_shows_the_burst_in_its_bucket(cluster, console, browser):
    due_ms = None
    await _send(cluster, "console.burst", [f"chart-{i}" for i in range(20)], delay_ms=10 * 60_000)
    r = _resolver(cluster)
    try:
        async with Producer(r) as p:
            due_ms = (await p.lookup("chart-0")).deliver_at_ms
    finally:
        await r.close()
    browser.get(console.url + "/schedule")
    table = _css(browser, "table.schedule")
    assert table, "no schedule chart"
    slot = int(table[0].get_attribute("data-slot-ms"))
    rows = {int(e.get_attribute("data-start")): int(e.find_element("css selector", ".count").text)
            for e in table[0].find_elements("css selector", "tr.slot")}
    assert rows.get(due_ms - due_ms % slot, 0) >= 20


async def test_the_schedule_page_shows_a_subjects_burst_under_that_subject(cluster, console, browser):
    from selenium.webdriver.support.ui import Select

    soon = int(time.time() * 1000) + 10 * 60_000
    due_ms = soon - soon % 60_000 + 30_000  # the middle of a minute about ten minutes ahead
    await _send(cluster, "console.only", [f"only-{i}" for i in range(7)], deliver_at_ms=due_ms)
    browser.get(console.url + "/schedule")
    assert "console.only" in [e.get_attribute("value") for e in _css(browser, "#subject option")]
    Select(_css(browser, "#subject")[0]).select_by_value("console.only")
    _css(browser, "#subject-form button")[0].click()
    wait_for(browser, lambda d: _css(d, "#subject-shown"), "the page shows the chosen subject")
    assert int(_css(browser, 'tr.total[data-group="delay-g1"] .count')[0].text) == 7  # its burst alone
    for table in _css(browser, "table.schedule"):  # minute, hour and day views: the burst in its slot
        slot = int(table.get_attribute("data-slot-ms"))
        rows = {int(e.get_attribute("data-start")): int(e.find_element("css selector", ".count").text)
                for e in table.find_elements("css selector", "tr.slot")}
        first = min(rows) if rows else 0
        assert rows.get(max(first, due_ms - due_ms % slot)) == 7 and sum(rows.values()) == 7, (slot, rows)
    # the minute view of one subject has minute rows: the node keeps its counts per minute
    assert int(_css(browser, "table.schedule")[0].get_attribute("data-slot-ms")) == 60_000
    shot(browser, "schedule-subject")
    r = _resolver(cluster)
    try:
        async with Producer(r) as p:
            for i in range(3):
                await p.cancel(f"only-{i}")
    finally:
        await r.close()
    browser.get(console.url + "/schedule?subject=console.only")
    assert int(_css(browser, 'tr.total[data-group="delay-g1"] .count')[0].text) == 4
    minute = _css(browser, "table.schedule")[0]
    rows = {int(e.get_attribute("data-start")): int(e.find_element("css selector", ".count").text)
            for e in minute.find_elements("css selector", "tr.slot")}
    assert {k: v for k, v in rows.items() if v} == {due_ms - due_ms % 60_000: 4}, rows


async def test_the_slave_reports_the_same_pending_counts_as_its_master(cluster):
    # the burst of the tests above is due in 10 minutes: once the slave holds the master's
    # checkpoint, its own counts (a slave fires nothing) agree with the master's
    from cluster.devcluster import wait_until

    async def agree():
        st = await cluster.statuses("delay")
        views = [(v["pending_by_bucket"], v["pending_by_minute"]) for v in st.values()]
        return len(views) == 2 and views[0] == views[1] and sum(views[0][0].values()) >= 20

    assert await wait_until(agree, 60, "the slave's pending counts equal to the master's")


async def test_the_subjects_page_lists_subjects_with_their_flow(cluster, console, browser):
    browser.get(console.url + "/subjects")
    before = int(_css(browser, 'tr.flow[data-group="realtime-1"] .delivered')[0].text)
    await _send(cluster, "console.flow", [f"flow-{i}" for i in range(5)], immediate=True)
    r = _resolver(cluster)
    try:
        async with Consumer(r, "console.flow", group="g") as cons:
            assert len(await receive_ids(cons, {f"flow-{i}" for i in range(5)})) == 5
    finally:
        await r.close()
    browser.get(console.url + "/subjects")
    row = _css(browser, 'tr.flow[data-group="realtime-1"]')[0]
    assert "console.flow" in {e.get_attribute("data-subject") for e in row.find_elements("css selector", ".subject")}
    assert int(row.find_element("css selector", ".delivered").text) >= before + 5
    consumer = _css(browser, 'tr.consumer[data-subject="console.flow"][data-group="g"]')
    assert consumer, "the consumer group of console.flow is listed"
    assert int(consumer[0].find_element("css selector", ".lag").text) == 0  # all five received and acked
    shot(browser, "subjects")


async def test_a_delivered_messages_trace_shows_each_hop_in_order(cluster, console, browser):
    await _send(cluster, "console.trace", ["traced-1"], delay_ms=500)
    r = _resolver(cluster)
    try:
        async with Consumer(r, "console.trace", group="g") as cons:
            assert "traced-1" in await receive_ids(cons, {"traced-1"})

        async def recorded() -> bool:  # a consumer may have it before the delay node recorded the dispatch
            async with Producer(r) as p:
                return (await p.lookup("traced-1")).status == "dispatched"
        from cluster.devcluster import wait_until
        assert await wait_until(recorded, 60, "the delay node recording traced-1 as dispatched")
    finally:
        await r.close()
    browser.get(console.url + "/message?id=traced-1")
    assert _css(browser, "#state")[0].text == "dispatched"
    hops = [(e.get_attribute("data-hop"), e.get_attribute("data-state")) for e in _css(browser, "li.hop")]
    # the consumer closed: its ack was sent; the real-time node's Consumer/Trace says so
    done = ["accepted", "filed", "fired", "stored at the real-time node", "delivered to g", "acked by g"]
    assert [h for h, s in hops if s == "done"] == done
    assert [h for h, _ in hops][:6] == done
    assert dict(hops)["dead-lettered"] == "skipped" and dict(hops)["cancelled"] == "skipped"
    accepted = _css(browser, 'li.hop[data-hop="accepted"]')[0].text
    assert "store epoch" in accepted and ", at 20" in accepted, accepted  # the Lookup says when and which term
    master = await cluster.wait_master("delay")
    assert f"(node {master}, store epoch " in accepted, accepted  # and which node: the group's term table
    assert not _css(browser, "#cancel"), "a dispatched message has no Cancel button"
    shot(browser, "message")
    # the same trace from the command line
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "trace", "traced-1",
                          "--meta", ",".join(cluster.meta_addresses)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    done = [line.split("]", 1)[1].split("  ")[0].strip() for line in out.stdout.splitlines() if "[x]" in line]
    assert done == ["accepted", "filed", "fired", "stored at the real-time node", "delivered to g", "acked by g"], \
        out.stdout


async def test_cancel_from_the_page_cancels_and_lookup_agrees(cluster, console, browser):
    await _send(cluster, "console.cancel", ["to-cancel"], delay_ms=10 * 60_000)
    browser.get(console.url + "/message?id=to-cancel")
    assert _css(browser, "#state")[0].text == "pending"
    _css(browser, "#cancel")[0].click()
    wait_for(browser, lambda d: d.switch_to.alert, "the confirmation").accept()
    wait_for(browser, lambda d: _css(d, "#state") and _css(d, "#state")[0].text == "cancelled",
             "the page showing the message cancelled")
    assert any("cancelled to-cancel" in e.text for e in _css(browser, ".flash"))
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "lookup", "to-cancel",
                          "--meta", ",".join(cluster.meta_addresses)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "cancelled"


async def test_a_dead_letter_sent_back_from_the_page_is_delivered(cluster, console, browser):
    subject = "console.dead"
    await _send(cluster, subject, ["doomed-1"], immediate=True)
    r = _resolver(cluster)
    try:
        async with Consumer(r, subject, group="g") as cons:
            nacks = 0
            for _ in range(POLLS_MAX):  # nack every delivery until the node dead-letters it
                batch = await cons.pull(wait_ms=500)
                if batch:
                    await cons.nack(batch, retry_after_ms=0)
                    nacks += len(batch)
                if nacks >= MAX_ATTEMPTS:
                    break
            assert nacks == MAX_ATTEMPTS
            browser.get(console.url + "/dead-letters")
            wait_for(browser, lambda d: d.refresh() or _css(d, 'tr.dead[data-id="doomed-1"]'),
                     "the dead letter listed")
            row = _css(browser, 'tr.dead[data-id="doomed-1"]')[0]
            assert subject in row.text and f"{MAX_ATTEMPTS} delivery attempts" in row.text
            # listed without consuming: the console's group holds nothing in flight
            rt = next(iter((await cluster.statuses("realtime")).values()))
            held = [g["in_flight"] for g in rt["groups"]
                    if (g["subject"], g["group"]) == ("hourglass.dlq", "hourglass-console")]
            assert held in ([], [0]), rt["groups"]
            shot(browser, "dead-letters")
            row.find_element("css selector", "input[type=checkbox]").click()
            _css(browser, "#send-back")[0].click()
            wait_for(browser, lambda d: any("sent 1 dead letter" in e.text for e in _css(d, ".flash")),
                     "the send-back confirmed")
            assert not _css(browser, 'tr.dead[data-id="doomed-1"]')
            assert "doomed-1" in await receive_ids(cons, {"doomed-1"})
    finally:
        await r.close()


def test_the_schedule_page_shows_the_lateness_of_fired_messages(cluster, console, browser):
    # the messages of the tests above were fired (traced-1 after its delay): the delay master
    # reports their lateness over the last hour
    browser.get(console.url + "/schedule")
    text = _css(browser, 'tr.total[data-group="delay-g1"] .lateness')[0].text
    assert text.startswith("p50 ") and " fired in the last 60 min" in text, text
    shot(browser, "schedule")
