"""Settings of one node process: one typed model, environment prefix ``HOURGLASS_``, the
root of the node's settings tree.

Every queue, batch, retry and wait has a named maximum here. The names are flat (every
``HOURGLASS_*`` variable a deployment sets keeps working); the typed sections the stores and
cores take are built from them by name (``section``: ``store``, ``realtime``, ``scrub``,
``disk``, ``limits``), and their defaults are written once, in the section's class.
docs/settings.md lists the whole tree. ``hourglass node``
maps its options onto this model; anything not given comes from the environment
(``HOURGLASS_DATA_DIR=/var/lib/hourglass``, ``HOURGLASS_ROLE=delay`` ...) or the default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cluster import quota as Q
from cluster.clientsettings import CLIENT_DEFAULTS
from cluster.transport import MESSAGE_BYTES_MAX
from node.store.diskspace import DiskWatermark
from node.store.records import DEFAULT_LIMITS, Limits
from node.store.settings import DISK_DEFAULTS as W
from node.store.settings import REALTIME_DEFAULTS as R
from node.store.settings import SCRUB_DEFAULTS as C
from node.store.settings import STORE_DEFAULTS as S
from node.store.settings import RealtimeSettings, ScrubSettings, StoreSettings

D = CLIENT_DEFAULTS.discovery  # the node's meta server calls are the SDK's (cluster/discovery.py)

# The sections of the tree: NodeSettings builds each by name (``section``) from its own fields.
# A section's defaults are written once, in its class (node/store/settings.py; cluster/codec.py
# for Limits); NodeSettings' field for it refers to that default and can set it as
# HOURGLASS_<FIELD> (tests/test_config.py checks both). The node's field has the section
# field's name unless the section's map below renames it (NodeSettings field -> section field).
STORE_FIELDS = {"delay_dedupe_window_ms": "dedupe_window_ms"}
REALTIME_FIELDS = {"realtime_segment_bytes": "segment_bytes", "realtime_retention_ms": "retention_ms",
                   "realtime_retention_bytes": "retention_bytes",
                   "realtime_frame_cache_bytes_max": "frame_cache_bytes_max"}
SCRUB_FIELDS = {"scrub_rate_mib_s": "rate_mib_s", "scrub_step_bytes_max": "step_bytes_max",
                "scrub_pass_interval_ms": "pass_interval_ms"}
DISK_FIELDS = {"disk_free_min_bytes": "free_min_bytes", "disk_free_min_ratio": "free_min_ratio",
               "disk_resume_margin_ratio": "resume_margin_ratio",
               "disk_resume_margin_bytes_max": "resume_margin_bytes_max"}
SECTIONS = {"store": (StoreSettings, STORE_FIELDS), "realtime": (RealtimeSettings, REALTIME_FIELDS),
            "scrub": (ScrubSettings, SCRUB_FIELDS), "disk": (DiskWatermark, DISK_FIELDS), "limits": (Limits, {})}
SECTION_DEFAULTS = {"store": S, "realtime": R, "scrub": C, "disk": W, "limits": DEFAULT_LIMITS}


class NodeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HOURGLASS_", extra="forbid")

    role: Literal["delay", "realtime"] = "delay"
    node_id: str = "node-1"
    group: str = "g1"
    data_dir: Path = Path("./var/node-1")
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port; 0 = pick a free one")
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="Prometheus port; 0 = free one")
    # the /metrics endpoint (docs/operations.md "Metrics endpoint"): where it listens (the chart: the
    # pod IP), and optionally HTTPS and a bearer token (off by default)
    metrics_host: str = Field(default="127.0.0.1", description="address the metrics endpoint binds")
    metrics_tls_cert_file: Path | None = None
    metrics_tls_key_file: Path | None = None
    metrics_token_file: Path | None = Field(default=None, description="scrapes must send this bearer token")
    health_port: int | None = Field(default=None, ge=0, le=65535,
                                    description="plaintext grpc.health.v1 only, for Kubernetes probes (TLS on `port`)")
    advertise: str | None = None  # address others use to reach this node (default host:port)
    ready_file: Path | None = None  # written with "host:port" once serving (tests, dev up)

    # routing before the meta server exists (static); realtime nodes for a delay node, delay nodes for nacks
    realtime_nodes: list[str] = []
    delay_nodes: list[str] = []
    meta_servers: list[str] = []
    # with meta_servers: registration under an etcd lease (node/registration.py) and discovery
    # 6 s / 1 s: chosen from the renewal gaps measured under load with the meta server paused 1.8 s
    # (docs/replication.md, "Lease timing under load"): worst gap ~4 s < TTL - margin = 4.8 s
    meta_lease_ttl_ms: int = Field(default=6000, ge=2000, le=300_000)
    meta_heartbeat_ms: int = Field(default=0, ge=0, description="0 = a third of the granted TTL, at most 1 s")
    meta_timeout_ms: int = Field(default=D.meta_timeout_ms, ge=100)
    meta_refresh_ms: int = Field(default=D.refresh_ms, ge=100, description="routes are asked again after this long")
    # replication (node/replication/): with ``replicated`` the node joins its group's election
    replicated: bool = False
    ack_mode: Literal["async", "sync"] = "async"
    sync_timeout_ms: int = Field(default=5000, ge=100)
    in_sync_lag_max_ms: int = Field(default=10_000, ge=100, le=600_000,
                                    description="a slave not seen fetching this long leaves the in-sync set "
                                                "(only while the master and one other member stay in it)")
    dead_master_refusals: int = Field(default=2, ge=1, le=100,
                                      description="refused connects to the master before a slave reports it dead")
    replication_wait_ms: int = Field(default=50, ge=5, le=1000, description="long-poll cap = tick state period")
    replication_idle_wait_ms: int = Field(default=1000, ge=5, le=5000,
                                          description="long-poll cap while the master's log and tick state have "
                                                      "not changed beyond the clock (docs/replication.md)")
    replication_chunk_bytes: int = Field(default=1 << 20, ge=4096, le=64 << 20)
    campaign_step_ms: int = Field(default=200, ge=0)
    min_term_ms: int = Field(default=5000, ge=0, le=600_000,
                             description="a master that stood down does not contest the seat again for this long "
                                         "while another member is registered: the new master keeps its seat")
    leader_poll_ms: int = Field(default=100, ge=10)
    leader_wait_ms: int = Field(default=1000, ge=0, le=30_000,
                                description="a member whose role is settled asks the meta server who leads with a "
                                            "long poll of up to this long (answered at once on a change; 0: poll "
                                            "every leader_poll_ms, docs/replication.md \"Leader long poll\")")
    ack_journal: Path | None = Field(default=None,
                                     description="append this master's acknowledgement windows here (JSON lines "
                                                 "for the chaos checker, node/replication/ackjournal.py); off if unset")

    # limits a producer can hit; the defaults are cluster.codec.Limits' (docs/api.md, "Limits")
    payload_bytes_max: int = Field(default=DEFAULT_LIMITS.payload_bytes_max, ge=1)
    subject_bytes_max: int = Field(default=DEFAULT_LIMITS.subject_bytes_max, ge=1)
    id_bytes_max: int = Field(default=DEFAULT_LIMITS.id_bytes_max, ge=1)
    delay_horizon_ms: int = Field(default=DEFAULT_LIMITS.delay_horizon_ms, ge=1,
                                  description="a message may be due at most this far ahead (default 732 days)")
    batch_messages_max: int = Field(default=DEFAULT_LIMITS.batch_messages_max, ge=1)
    batch_bytes_max: int = Field(default=DEFAULT_LIMITS.batch_bytes_max, ge=1,
                                 description="bytes of one batch's messages (a real-time frame holds one batch)")
    tags_max: int = Field(default=DEFAULT_LIMITS.tags_max, ge=0, description="tags of one message")
    tag_bytes_max: int = Field(default=DEFAULT_LIMITS.tag_bytes_max, ge=1, description="bytes of one tag")
    properties_max: int = Field(default=DEFAULT_LIMITS.properties_max, ge=0, description="properties of one message")
    property_key_bytes_max: int = Field(default=DEFAULT_LIMITS.property_key_bytes_max, ge=1,
                                        description="bytes of one property's key")
    property_value_bytes_max: int = Field(default=DEFAULT_LIMITS.property_value_bytes_max, ge=1,
                                          description="bytes of one property's value")
    request_bytes_max: int = Field(default=MESSAGE_BYTES_MAX, ge=1, description="gRPC message size, both ways")
    loop_stall_report_ms: int = Field(default=200, ge=0,
                                      description="log each event-loop stall this long or longer, with its "
                                                  "duration and where the loop was (0 = off)")
    loop_stall_max_ms: int = Field(default=8000, ge=500, le=300_000,
                                   description="the heartbeat thread stops renewing the registration while the "
                                               "event loop has not turned for this long: a wedged node gives up "
                                               "its lease (and a master its seat)")
    stream_window_max: int = Field(default=8, ge=1,
                                   description="requests of one SendBatchStream answered at once (in order)")

    # delay node
    tick_ms: int = Field(default=S.tick_ms, ge=1)
    window_ms: int = Field(default=S.window_ms, ge=1, description="the wheel loads a second this long before it starts")
    bucket_ms: int = Field(default=S.bucket_ms, ge=1000, description="schedule bucket length (fixed at creation)")
    checkpoint_interval_ms: int = 200
    checkpoint_idle_interval_ms: int = Field(default=10_000, ge=0, le=600_000,
                                             description="a checkpoint that would only move completed_ms (nothing "
                                                         "filed, dispatched, cancelled or written since the last) "
                                                         "is written this often instead of every "
                                                         "checkpoint_interval_ms (docs/operations.md, Idle)")
    wheel_idle_wait_ms_max: int = Field(default=1000, ge=1, le=60_000,
                                        description="the wheel loop, with nothing due and no second to load, "
                                                    "sleeps at most this long (woken at once by new work)")
    iterate_interval_ms: int = 2
    dispatch_batch_max: int = 10_000       # messages per dispatch RPC (a larger due batch is split)
    dispatch_concurrency_max: int = 2      # dispatch rounds in flight; due messages gather while they run
    # firing rounds at least this far apart (batches under load); with the lead below, a round
    # leaves 8-15 ms before its messages are due, so the interval costs no lateness, and each
    # round (one stream message each way, ~220 us of CPU per side: bench/bench_grpc.py) carries
    # more (issue 28: 3 -> 7 ms, docs/benchmarks.md "Fewer, fuller rounds")
    dispatch_round_interval_ms: int = 7
    dispatch_round_interval_busy_ms: int = 7  # ... and this far after a round of dispatch_round_busy_messages or more
    dispatch_round_busy_messages: int = 32
    dispatch_lead_ms: int = Field(default=15, ge=0, le=1000,
                                  description="a firing round takes messages due this far ahead; the real-time "
                                              "node holds them until due (must stay below visible_hold_ms_max)")
    dispatch_attempts_max: int = 8         # permanent errors: dead letter after this many tries
    dispatch_backoff_ms_max: int = 2000
    # draining the group (`hourglass admin drain`, docs/design.md "Draining a delay group")
    drain_poll_ms: int = Field(default=1000, ge=50, le=60_000,
                               description="a delay master asks the meta servers this often whether its group "
                                           "drains, and moves a round of its pending messages")
    drain_horizon_ms: int = Field(default=5000, ge=1000, le=600_000,
                                  description="a draining group fires messages due within this long itself "
                                              "instead of moving them (the wheel's window plus a margin)")
    drain_batch_max: int = Field(default=2000, ge=1, le=100_000,
                                 description="messages a draining master moves per SendBatch to another group")
    drain_round_max: int = Field(default=20_000, ge=1, le=10_000_000,
                                 description="messages a draining master moves per drain_poll_ms at most (the "
                                             "load a drain puts on the other groups)")
    inflight_max: int = Field(default=S.inflight_max, ge=1, description="fired, not yet acknowledged messages")
    unfiled_max: int = Field(default=S.unfiled_max, ge=1, description="accepted, not yet filed messages")
    wheel_entries_max: int = Field(default=S.wheel_entries_max, ge=1, description="messages in the timing wheel")
    schedule_cache_bytes_max: int = Field(default=S.schedule_cache_bytes_max, ge=0,
                                          description="decoded schedule frames kept for the wheel")
    cache_ahead_ms: int = Field(default=S.cache_ahead_ms, ge=0,
                                description="frames due this far past the loaded seconds are cached when filed")
    seconds_load_max: int = Field(default=S.seconds_load_max, ge=1, description="seconds loaded from disk per poll")
    file_step_max: int = Field(default=S.file_step_max, ge=1, description="records a master files per step of its filing loop (the loop yields to other work between steps)")
    follower_file_step_max: int = Field(default=S.follower_file_step_max, ge=1, description="records a slave files per step (it also applies replicated bytes on its loop)")
    frame_bytes_max: int = Field(default=S.frame_bytes_max, ge=4096,
                                 description="a larger accepted batch is appended as several frames")
    verify_ahead_ms: int = Field(default=S.verify_ahead_ms, ge=0,
                                 description="at open, frames due this far ahead are verified before serving")
    subject_table_stale_entries_max: int = Field(default=S.subject_table_stale_entries_max, ge=1,
                                                 description="index entries filed into a schedule bucket before a "
                                                             "checkpoint writes its subject table again (a restart "
                                                             "reads at most that many frames per bucket)")
    subject_tables_per_checkpoint_max: int = Field(default=S.subject_tables_per_checkpoint_max, ge=1,
                                                   description="subject tables one checkpoint writes at most "
                                                               "(the stalest first)")

    # segment sizes (a segment is the unit retention deletes)
    message_segment_bytes: int = Field(default=S.message_segment_bytes, ge=4096)
    dispatch_segment_bytes: int = Field(default=S.dispatch_segment_bytes, ge=4096)
    schedule_segment_bytes: int = Field(default=S.schedule_segment_bytes, ge=4096)
    id_entries_max: int = Field(default=S.id_entries_max, ge=16, description="entries per id-index file")
    id_slots: int = Field(default=S.id_slots, ge=16)

    # disk lifecycle (docs/operations.md "Disk", rules in node/store/diskspace.py): a write is admitted
    # only if it leaves min(disk_free_min_bytes, disk_free_min_ratio x disk size) free; once refusing,
    # writes resume above that mark plus min(disk_resume_margin_ratio x disk size, ..._bytes_max)
    disk_free_min_bytes: int = Field(default=W.free_min_bytes, ge=0,
                                     description="the mark: free bytes writes never take")
    disk_free_min_ratio: float = Field(default=W.free_min_ratio, ge=0, le=0.9,
                                       description="... or this share of the disk, whichever is smaller")
    disk_resume_margin_ratio: float = Field(default=W.resume_margin_ratio, ge=0, le=0.5,
                                            description="writes resume at the mark plus this share of the disk ...")
    disk_resume_margin_bytes_max: int = Field(default=W.resume_margin_bytes_max, ge=0,
                                              description="... or this many bytes, whichever is smaller")
    disk_check_interval_ms: int = Field(default=1000, ge=10, description="free space is read this often")
    retention_interval_ms: int = Field(default=10_000, ge=10, description="how often retention runs")
    delay_dedupe_window_ms: int = Field(default=S.dedupe_window_ms, ge=0,
                                        description="ids of delivered/cancelled messages kept for re-send dedupe")
    id_compact_ratio_min: float = Field(default=S.id_compact_ratio_min, gt=0, le=1)
    realtime_retention_ms: int = Field(default=R.retention_ms, ge=0, description="consumed real-time segments kept")
    realtime_retention_bytes: int = Field(default=R.retention_bytes, ge=0, description="0 = no size trigger")
    realtime_segment_bytes: int = Field(default=R.segment_bytes, ge=4096)
    group_idle_ms_max: int = Field(default=R.group_idle_ms_max, ge=1000,
                                   description="a consumer group idle this long stops holding data back")
    index_compact_entries_min: int = Field(default=R.index_compact_entries_min, ge=1,
                                           description="dead index entries before a subject's index is rewritten")

    # real-time node
    dedup_window_ms: int = Field(default=R.dedup_window_ms, ge=0)
    dedup_entries_max: int = Field(default=R.dedup_entries_max, ge=1,
                                   description="dedup map size; beyond it the oldest ids are forgotten early")
    ack_timeout_ms: int = Field(default=R.ack_timeout_ms, ge=1)
    inflight_per_group_max: int = Field(default=R.inflight_per_group_max, ge=1,
                                        description="pulled, unacked messages per (subject, group)")
    pull_max: int = Field(default=R.pull_max, ge=1)
    pull_wait_ms_max: int = 30_000
    max_attempts: int = Field(default=R.max_attempts, ge=1)
    auto_create_subjects: bool = R.auto_create_subjects
    subjects: list[str] = []
    subjects_max: int = Field(default=R.subjects_max, ge=1)
    # per-principal subject quotas (docs/security.md "Subject quotas"; cluster/quota.py)
    subjects_new_per_minute_max: int = Field(default=Q.NEW_PER_MINUTE_MAX_DEFAULT, ge=1,
                                             description="new subjects one principal may create per minute on this "
                                                         "node (a burst of a minute's worth)")
    subjects_owned_max: int = Field(default=Q.OWNED_MAX_DEFAULT, ge=1,
                                    description="subjects one principal may have created on this node")
    subjects_round_max: int = Field(default=1000, ge=1,
                                    description="new subjects created in one round (one index-folder fsync and one "
                                                "journal record)")
    subjects_new_per_frame_max: int = Field(default=64, ge=1,
                                            description="new subjects one frame (one step of the event loop) writes "
                                                        "first index entries for; a send with more is stored as several "
                                                        "frames, the loop serving other calls between them")
    subjects_per_frame_max: int = Field(default=128, ge=1,
                                        description="subjects one frame (one step of the event loop) writes index "
                                                    "entries for; a send of more is stored as several frames")
    groups_max: int = Field(default=R.groups_max, ge=1)
    pull_scan_entries_max: int = Field(default=R.pull_scan_entries_max, ge=1,
                                       description="index entries one pull may examine (tag filters skip entries)")
    index_files_open_max: int = Field(default=R.index_files_open_max, ge=1)
    realtime_frame_cache_bytes_max: int = Field(default=R.frame_cache_bytes_max, ge=0,
                                                description="decoded recent frames kept for pulls")
    offsets_compact_bytes: int = Field(default=R.offsets_compact_bytes, ge=4096)
    checkpoint_bytes_min: int = Field(default=R.checkpoint_bytes_min, ge=0)
    checkpoint_index_fsyncs_max: int = Field(default=R.checkpoint_index_fsyncs_max, ge=1,
                                             description="index files and folders one periodic checkpoint fsyncs "
                                                         "at most (oldest first; it vouches only below the rest)")
    visible_hold_ms_max: int = Field(default=R.visible_hold_ms_max, ge=0, le=60_000,
                                     description="a message stored ahead of its due time is handed out when due, "
                                                 "held at most this long")
    visible_step_ms: int = Field(default=R.visible_step_ms, ge=1, le=1000,
                                 description="... at its due time rounded up to a multiple of this (batches pulls)")

    # what Admin/Status reports for the console (docs/console.md, "Node-side support")
    status_buckets_max: int = Field(default=20_000, ge=1,
                                    description="pending_by_bucket entries one delay Status carries at most "
                                                "(the earliest buckets; 2 years of 1 h buckets is 17,520)")
    pending_by_minute_horizon_ms: int = Field(default=3_600_000, ge=3_600_000, le=86_400_000,
                                              description="pending_by_minute covers the buckets starting before "
                                                          "now + this (whole buckets; the console's minute view "
                                                          "is an hour)")
    pending_by_minute_buckets_max: int = Field(default=4, ge=1, le=1000,
                                               description="buckets whose per-second index counts a delay node "
                                                           "keeps for pending_by_minute")
    lateness_window_ms: int = Field(default=3_600_000, ge=60_000,
                                    description="the window of the lateness p50/p99 in a delay Status")
    lateness_slot_ms: int = Field(default=60_000, ge=1000,
                                  description="the window moves in steps this long (one histogram a step)")
    master_changes_window_ms: int = Field(default=3_600_000, ge=60_000,
                                          description="master_changes_1h in Status counts role changes this recent")
    master_changes_kept_max: int = Field(default=256, ge=1,
                                         description="role-change times a node keeps (a storm counts as this many)")
    status_subjects_max: int = Field(default=20, ge=1, le=1000,
                                     description="subjects a delay Status names in pending_subjects (most "
                                                 "pending first; the rest summed as \"(other)\")")
    status_groups_max: int = Field(default=1000, ge=1,
                                   description="(subject, consumer group) rows one real-time Status carries at most")

    # clock (tests inject skew; allow_clock_control lets an admin call move it forward)
    clock_offset_ms: int = 0
    allow_clock_control: bool = False

    # scrubbing and verify (docs/operations.md "Self-healing and scrubbing")
    scrub_rate_mib_s: float = Field(default=C.rate_mib_s, ge=0, description="background CRC re-check rate; 0 = off")
    scrub_step_bytes_max: int = Field(default=C.step_bytes_max, ge=4096, description="bytes read per scrub step")
    scrub_pass_interval_ms: int = Field(default=C.pass_interval_ms, ge=0,
                                        description="a scrub pass starts at least this long after the previous one")
    verify_rate_mib_s: float = Field(default=C.verify_rate_mib_s, gt=0,
                                     description="read rate of `hourglass admin verify`")

    log_level: str = "INFO"

    @model_validator(mode="after")
    def _lead_within_hold(self) -> "NodeSettings":
        """A real-time node holds a message stored ahead of its due time at most
        ``visible_hold_ms_max``: a longer lead would deliver messages early."""
        if self.dispatch_lead_ms >= self.visible_hold_ms_max and self.dispatch_lead_ms > 0:
            raise ValueError(f"dispatch_lead_ms ({self.dispatch_lead_ms}) must be below visible_hold_ms_max "
                             f"({self.visible_hold_ms_max}): real-time nodes would hand messages out early")
        return self

    def limits(self) -> Limits:
        return self.section("limits")

    def store_settings(self) -> StoreSettings:
        return self.section("store")

    def scrub_settings(self) -> ScrubSettings:
        return self.section("scrub")

    def section(self, name: str):
        """The section ``name`` of ``SECTIONS``: every field from this model (its name, or the
        one the section's map gives), ``limits`` from ``limits()``."""
        cls, renamed = SECTIONS[name]
        name_of = {field: mine for mine, field in renamed.items()}
        values = {f: getattr(self, name_of.get(f, f)) for f in cls.__dataclass_fields__ if f != "limits"}
        if "limits" in cls.__dataclass_fields__:
            values["limits"] = self.limits()
        return cls(**values)

    def disk_watermark(self) -> DiskWatermark:
        return self.section("disk")

    def realtime_settings(self) -> RealtimeSettings:
        return self.section("realtime")
