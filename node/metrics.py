"""Prometheus metrics of one node process, on its own registry (several nodes may share a test process)."""

from __future__ import annotations

import datetime as _dt
import logging

import numpy as np

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cluster.metricsserver import ServesMetrics
from cluster.security import REFUSALS, THROTTLED_PEERS
from cluster.wire import REQUESTS

log = logging.getLogger("hourglass.metrics")

STALL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 10, 30)
CALL_BUCKETS_S = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
LATENESS_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class NodeMetrics(ServesMetrics):
    def __init__(self, role: str, node_id: str) -> None:
        self.registry = r = CollectorRegistry()
        r.register(REFUSALS)  # calls refused by authentication or permissions (cluster/security.py)
        r.register(THROTTLED_PEERS)  # peers refused for a window after too many failed authentications
        r.register(REQUESTS)  # requests served by method (cluster/wire.py)
        labels = {"role": role, "node": node_id}
        self.ingested = Counter("hourglass_ingested_messages", "Messages accepted (durable)", registry=r)
        self.dispatched = Counter("hourglass_dispatched_messages", "Delayed messages handed to real-time nodes",
                                  registry=r)
        self.dead_lettered = Counter("hourglass_dead_lettered_messages", "Messages sent to the dead-letter subject",
                                     registry=r)
        self.delivered = Counter("hourglass_pulled_messages", "Messages handed to consumers", registry=r)
        self.acked = Counter("hourglass_acked_messages", "Messages acknowledged by consumers", registry=r)
        self.errors = Counter("hourglass_errors", "Rejected messages and failed calls", ["kind"], registry=r)
        self.lateness = Histogram("hourglass_delivery_lateness_seconds", "Dispatch time minus due time",
                                  buckets=LATENESS_BUCKETS_S, registry=r)
        self.wheel_held = Gauge("hourglass_wheel_entries", "Entries held in the in-memory wheel", registry=r)
        self.in_flight = Gauge("hourglass_in_flight_messages", "Fired, not yet confirmed by a real-time node",
                               registry=r)
        self.dispatch_lag = Gauge("hourglass_dispatch_lag_seconds", "Wall clock minus completed_ms", registry=r)
        self.pending_by_bucket = Gauge("hourglass_pending_messages", "Messages filed and not yet dispatched, by bucket",
                                       ["bucket"], registry=r)
        self.consumer_lag = Gauge("hourglass_consumer_lag_messages", "Entries not yet acked", ["subject", "group"],
                                  registry=r)
        self.is_master = Gauge("hourglass_is_master", "1 when this node is its group's master, 0 for a slave",
                               registry=r)
        self.replication_lag_bytes = Gauge("hourglass_replication_lag_bytes",
                                           "Slave: message-log bytes the master has and this node has not", registry=r)
        self.replication_lag_seconds = Gauge("hourglass_replication_lag_seconds",
                                             "Slave: time since it was last caught up with the master (0 = caught up)",
                                             registry=r)
        self.disk_bytes = Gauge("hourglass_disk_bytes", "Bytes allocated on disk, by log (messages, schedule, ids, "
                                "dispatch; real-time: messages, index, groups)", ["log"], registry=r)
        self.disk_free_bytes = Gauge("hourglass_disk_free_bytes", "Free bytes on the data folder's file system",
                                     registry=r)
        self.disk_total_bytes = Gauge("hourglass_disk_total_bytes", "Size of the data folder's file system",
                                      registry=r)
        self.disk_low = Gauge("hourglass_disk_low", "1 while writes are refused for lack of disk space", registry=r)
        self.disk_refusals = Counter("hourglass_disk_full_refusals", "Write calls refused with DiskFull", registry=r)
        self.retention_freed = Counter("hourglass_retention_freed_bytes", "Bytes deleted by retention", registry=r)
        self.retention_held_age = Gauge("hourglass_retention_oldest_kept_age_seconds",
                                        "Age of the oldest piece retention could not delete yet, by log and reason "
                                        "(held_by: checkpoint, slave:{id}, group:{subject}/{group}, dedup, "
                                        "age/size, active segment, pending messages)", ["log", "held_by"],
                                        registry=r)
        self.idle_groups = Gauge("hourglass_retention_idle_groups",
                                 "Consumer groups idle past group_idle_ms_max (they hold no data back)", registry=r)
        self.idle_group_events = Counter("hourglass_retention_idle_group_events",
                                         "Real-time consumer groups that went idle (stopped holding data back) or "
                                         "came back (moved to the first entry still on disk)", ["event"], registry=r)
        self.retention_skipped = Counter("hourglass_retention_skipped_messages",
                                         "Messages an idle real-time consumer group never got: deleted while it "
                                         "was idle", registry=r)
        self.truncations_refused = Counter("hourglass_truncations_refused", "Divergent-suffix truncations refused "
                                           "because they would remove acknowledged records", registry=r)
        self.records_voided = Counter("hourglass_records_voided", "Records of divergent suffixes cut from the "
                                      "message log (never acknowledged)", registry=r)
        self.master_changes = Counter("hourglass_master_changes", "Times this node became master or stopped being "
                                      "master (rate per hour: increase(...[1h]))", ["to"], registry=r)
        # event loop and registration timing (docs/replication.md, "Lease timing under load")
        self.loop_stall = Histogram("hourglass_event_loop_stall_seconds",
                                    "How late the stall watch's wake-ups were (one every 50 ms): how long the event "
                                    "loop was held or the process starved", buckets=STALL_BUCKETS_S, registry=r)
        self.send_seconds = Histogram("hourglass_send_seconds",
                                      "A SendBatch on the SDK's stream, from its handler's start to its answer "
                                      "(stored and durable; on a replicated master also confirmed as the ack mode "
                                      "says; refusals included)", buckets=CALL_BUCKETS_S, registry=r)
        self.fsync_seconds = Histogram("hourglass_wal_fsync_seconds",
                                       "One group-commit fsync of the message log, on its thread",
                                       buckets=CALL_BUCKETS_S, registry=r)
        self.fsync_handback = Histogram("hourglass_wal_fsync_handback_seconds",
                                        "From a group-commit fsync's return to its completion running on the event "
                                        "loop: how long the loop was busy with other work", buckets=CALL_BUCKETS_S,
                                        registry=r)
        self.heartbeat_rtt = Histogram("hourglass_heartbeat_rtt_seconds",
                                       "Round trip of a registration Register/Heartbeat (heartbeat thread)",
                                       buckets=STALL_BUCKETS_S, registry=r)
        self.heartbeat_gap = Histogram("hourglass_heartbeat_gap_seconds",
                                       "From the send of one confirmed renewal to the confirmation of the next: how "
                                       "long the lease had to last on its own", buckets=STALL_BUCKETS_S, registry=r)
        self.registrations_lost = Counter("hourglass_registrations_lost",
                                          "Registrations found lost (lease expired or id taken); registered again",
                                          registry=r)
        self.heartbeats_withheld = Counter("hourglass_heartbeats_withheld",
                                           "Stalls past loop_stall_max_ms during which the heartbeat thread "
                                           "stopped renewing the lease", registry=r)
        self.election_epoch = Gauge("hourglass_election_epoch", "Newest election epoch seen", registry=r)
        self.info = Gauge("hourglass_node_info", "Node identity", list(labels), registry=r)
        self.info.labels(**labels).set(1)
        # self-healing and scrubbing (docs/operations.md "Self-healing and scrubbing")
        self.scrub_bytes = Counter("hourglass_scrub_bytes", "Bytes of segments re-checked by the scrub", registry=r)
        self.scrub_passes = Gauge("hourglass_scrub_passes", "Scrub passes over every segment finished", registry=r)
        self.scrub_progress = Gauge("hourglass_scrub_pass_progress_ratio", "How far the current scrub pass is (0..1)",
                                    registry=r)
        self.corrupt_found = Counter("hourglass_corrupt_records_found", "Corrupt records found, by where "
                                     "(schedule, messages, dispatch)", ["kind"], registry=r)
        self.corrupt_repaired = Counter("hourglass_corrupt_records_repaired", "Corrupt records repaired (schedule "
                                        "buckets rebuilt, segments fetched again from a slave)", ["kind"], registry=r)
        self.lost_records = Counter("hourglass_lost_records", "Acknowledged records (messages, cancels) lost: held "
                                    "only by a corrupt schedule frame, in no message log and on no member of the "
                                    "group (their ids: the ERROR log line, hourglass admin verify)", registry=r)
        self.missing_records = Gauge("hourglass_missing_records", "Records a rebuilt schedule bucket lacks that are "
                                     "being fetched from another member of the group", registry=r)
        self.fetched_records = Counter("hourglass_fetched_records", "Missing records of a rebuilt schedule bucket "
                                       "given back by another member of the group", registry=r)
        self.heal_faults = Counter("hourglass_heal_faults", "Second faults met while healing, by kind (messages, "
                                   "dispatch: a corrupt record a rebuild read around; fetch: a member that could "
                                   "not give missing records; rebuild: a rebuild that failed)", ["kind"], registry=r)
        self._buckets_shown: set[str] = set()

    def observe_commit(self, fsync_s: float, handback_s: float) -> None:
        """One group-commit round's timing (``GroupCommitter.run(observe)``)."""
        self.fsync_seconds.observe(fsync_s)
        self.fsync_handback.observe(handback_s)

    def observe_lateness(self, lateness_s: np.ndarray) -> None:
        """Observe a whole batch of lateness values at once (one bucket count per bucket,
        not one ``observe`` per message). Uses the histogram's bucket counters the way
        ``Histogram.observe`` does: a value goes to the first bucket whose bound it does
        not exceed."""
        if not len(lateness_s):
            return
        h = self.lateness
        bounds = np.asarray(h._upper_bounds, float)
        counts = np.bincount(np.searchsorted(bounds, lateness_s, side="left"), minlength=len(bounds))
        for bucket, c in zip(h._buckets, counts.tolist()):
            if c:
                bucket.inc(c)
        h._sum.inc(float(np.sum(lateness_s)))

    def set_pending(self, by_bucket_start_ms: dict[int, int]) -> None:
        """Replace the pending-by-bucket series (label: bucket start, UTC ISO, e.g. 2026-11-23T12:00Z)."""
        now = {(_dt.datetime.fromtimestamp(b / 1000, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")): n
               for b, n in by_bucket_start_ms.items()}
        for gone in self._buckets_shown - now.keys():
            self.pending_by_bucket.remove(gone)
        for label, n in now.items():
            self.pending_by_bucket.labels(bucket=label).set(n)
        self._buckets_shown = set(now)

    def set_retention_held(self, ages_s: dict[str, tuple[str, float]]) -> None:
        """Replace the retention-held series: log -> (held_by, age in seconds)."""
        self.retention_held_age.clear()
        for name, (why, age) in ages_s.items():
            self.retention_held_age.labels(log=name, held_by=why or "nothing").set(max(0.0, age))

