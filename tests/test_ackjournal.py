"""The acknowledgement journal (node/replication/ackjournal.py): what it writes, when, and that
the chaos checker reads it back as the windows the node acknowledged in."""

from __future__ import annotations

import json

from cluster.chaoscheck import ACK_WINDOW_PAD_MS, ack_windows
from node.config import NodeSettings
from node.replication.ackjournal import WRITE_INTERVAL_MS, AckJournal


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_worked_example_of_the_module(tmp_path):
    p = tmp_path / "acks.jsonl"
    j = AckJournal(p, node="delay-1", group="delay-g1", interval_ms=20)
    j.note(7, 1000)
    j.note(7, 1010)   # 10 ms after the last line: in memory only
    assert [x["last_ms"] for x in lines(p)] == [1000]
    j.note(7, 1025)
    j.note(9, 4000)   # the epoch changed; 7's latest state was written already
    assert lines(p) == [
        {"node": "delay-1", "group": "delay-g1", "epoch": 7, "first_ms": 1000, "last_ms": 1000},
        {"node": "delay-1", "group": "delay-g1", "epoch": 7, "first_ms": 1000, "last_ms": 1025},
        {"node": "delay-1", "group": "delay-g1", "epoch": 9, "first_ms": 4000, "last_ms": 4000},
    ]


def test_a_new_epoch_first_writes_what_the_old_window_held_in_memory(tmp_path):
    p = tmp_path / "acks.jsonl"
    j = AckJournal(p, node="n", group="g", interval_ms=20)
    j.note(3, 100)
    j.note(3, 105)
    j.note(4, 200)
    assert [(x["epoch"], x["first_ms"], x["last_ms"]) for x in lines(p)] == [(3, 100, 100), (3, 100, 105),
                                                                           (4, 200, 200)]
    j.note(4, 210)
    j.close()  # a graceful stop writes the tail too
    assert lines(p)[-1]["last_ms"] == 210


def test_the_checker_reads_a_journal_back_as_one_window_per_epoch(tmp_path):
    p = tmp_path / "acks.jsonl"
    j = AckJournal(p, node="delay-2", group="delay-g1")
    for t in range(5000, 6000, 7):
        j.note(12, t)
    for t in range(9000, 9100, 3):
        j.note(14, t)
    j.close()
    assert ack_windows([p]) == [
        {"group": "delay-g1", "node": "delay-2", "epoch": 12, "first_ms": 5000, "last_ms": 5994},
        {"group": "delay-g1", "node": "delay-2", "epoch": 14, "first_ms": 9000, "last_ms": 9099},
    ]


def test_a_journal_killed_mid_window_misses_less_than_the_checkers_pad(tmp_path):
    """No close (a SIGKILL): the lines on disk end at most one write interval before the last
    acknowledgement, which is what the checker extends every window by."""
    assert ACK_WINDOW_PAD_MS == WRITE_INTERVAL_MS
    p = tmp_path / "acks.jsonl"
    j = AckJournal(p, node="n", group="g")
    for t in range(0, 1000, 3):
        j.note(1, t)
    on_disk = ack_windows([p])[0]["last_ms"]
    assert 999 - WRITE_INTERVAL_MS < on_disk <= 999


def test_off_by_default_and_on_with_the_setting(tmp_path, monkeypatch):
    j = AckJournal.from_settings(NodeSettings())
    assert not j.enabled
    j.note(1, 1)  # a no-op
    monkeypatch.setenv("HOURGLASS_ACK_JOURNAL", str(tmp_path / "j" / "acks.jsonl"))
    s = NodeSettings(node_id="delay-3", group="delay-g2")
    j = AckJournal.from_settings(s)
    assert j.enabled
    j.note(5, 10)
    assert lines(tmp_path / "j" / "acks.jsonl") == [{"node": "delay-3", "group": "delay-g2", "epoch": 5,
                                                     "first_ms": 10, "last_ms": 10}]
