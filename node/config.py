"""Settings of one node process: one nested typed model, the node's settings tree.

The tree (``NodeSettings``; docs/settings.md lists every setting)::

    NodeSettings
      server       ServerSection       identity, addresses, ports, the metrics and health endpoints, log level
      meta         MetaSection         meta servers: registration lease, discovery, static routes before them
      replication  ReplicationSection  the group's election, shipping, acknowledgement
      limits       LimitsSection       what a producer can hit (-> ``Limits``, cluster/codec.py) and the RPC sizes
      store        StoreSection        the delay store: wheel, schedule, id index, segments (-> ``StoreSettings``)
      delay        DelaySection        the delay service: checkpoints, dispatch rounds, draining
      realtime     RealtimeSection     the real-time store and service (-> ``RealtimeSettings``)
      disk         DiskSection         the disk watermark (-> ``DiskWatermark``), free-space checks, retention
      scrub        ScrubSection        background CRC re-check and verify (-> ``ScrubSettings``)
      status       StatusSection       what Admin/Status reports for the console
      loop         LoopSection         the event-loop watchdog
      clock        ClockSection        clock skew and control (tests)

Code reads a setting by its path (``settings.store.tick_ms``). The stores and cores take the
frozen dataclasses of node/store/settings.py (``section("store")`` and friends build them from
the section of the same name); their defaults are written there, once, and the section's field
refers to it. A node-only setting's default is written here, once.

Environment: every setting keeps the flat name it had before the tree was nested, and
``HOURGLASS_<FLAT>`` sets it (``HOURGLASS_TICK_MS``, ``HOURGLASS_REALTIME_RETENTION_MS``,
``HOURGLASS_META_SERVERS='["10.0.0.5:7100"]'``): those names are the contract deployments
(the chart, dev clusters, operators' scripts) already hold. The flat name is the field's name
unless its section renames it (``FLAT``: ``realtime.retention_ms`` is
``realtime_retention_ms``); ``FLAT_NAMES`` maps each flat name to one path, and each path has
one flat name. The nested form works too (``HOURGLASS_STORE__TICK_MS``); a flat variable wins
over a nested one. Keyword arguments may be flat as well (``NodeSettings(tick_ms=5,
role="realtime")``, as ``hourglass node`` and the tests build it) or nested
(``NodeSettings(store={"tick_ms": 5})``); ``replace(**flat)`` is a validated copy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar, Literal, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

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
ENV_PREFIX = "HOURGLASS_"


class _Section(BaseModel):
    """A section of the tree. ``FLAT`` renames a field's flat (environment) name; by default
    it is the field's own name."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    FLAT: ClassVar[dict[str, str]] = {}


class ServerSection(_Section):
    """The process: its identity, addresses and ports, the metrics and health endpoints, logging."""

    role: Literal["delay", "realtime"] = "delay"
    node_id: str = "node-1"
    group: str = "g1"
    data_dir: Path = Path("./var/node-1")
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port; 0 = pick a free one")
    advertise: str | None = Field(default=None, description="address others use to reach this node (default "
                                                            "host:port)")
    ready_file: Path | None = Field(default=None, description="written with \"host:port\" once serving (tests, "
                                                              "dev up)")
    health_port: int | None = Field(default=None, ge=0, le=65535,
                                    description="plaintext grpc.health.v1 only, for Kubernetes probes (TLS on `port`)")
    # the /metrics endpoint (docs/operations.md "Metrics endpoint"): where it listens (the chart: the
    # pod IP), and optionally HTTPS and a bearer token (off by default)
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="Prometheus port; 0 = free one")
    metrics_host: str = Field(default="127.0.0.1", description="address the metrics endpoint binds")
    metrics_tls_cert_file: Path | None = None
    metrics_tls_key_file: Path | None = None
    metrics_token_file: Path | None = Field(default=None, description="scrapes must send this bearer token")
    log_level: str = "INFO"


class MetaSection(_Section):
    """The meta servers: registration under an etcd lease (node/registration.py), discovery, and
    the static routes used without them."""

    FLAT: ClassVar[dict[str, str]] = {"servers": "meta_servers", "lease_ttl_ms": "meta_lease_ttl_ms",
                                      "heartbeat_ms": "meta_heartbeat_ms", "timeout_ms": "meta_timeout_ms",
                                      "refresh_ms": "meta_refresh_ms"}

    servers: list[str] = Field(default=[], description="meta server addresses: register there and discover "
                                                       "through them")
    # with servers: registration under an etcd lease (node/registration.py) and discovery
    # 6 s / 1 s: chosen from the renewal gaps measured under load with the meta server paused 1.8 s
    # (docs/replication.md, "Lease timing under load"): worst gap ~4 s < TTL - margin = 4.8 s
    lease_ttl_ms: int = Field(default=6000, ge=2000, le=300_000)
    heartbeat_ms: int = Field(default=0, ge=0, description="0 = a third of the granted TTL, at most 1 s")
    timeout_ms: int = Field(default=D.meta_timeout_ms, ge=100)
    refresh_ms: int = Field(default=D.refresh_ms, ge=100, description="routes are asked again after this long")
    # routing before the meta server exists (static); realtime nodes for a delay node, delay nodes for nacks
    realtime_nodes: list[str] = []
    delay_nodes: list[str] = []


class ReplicationSection(_Section):
    """Replication (node/replication/, docs/replication.md): the group's election, shipping,
    acknowledgement."""

    FLAT: ClassVar[dict[str, str]] = {"enabled": "replicated", "wait_ms": "replication_wait_ms",
                                      "idle_wait_ms": "replication_idle_wait_ms",
                                      "chunk_bytes": "replication_chunk_bytes"}

    # with ``enabled`` the node joins its group's election
    enabled: bool = False
    ack_mode: Literal["async", "sync"] = "async"
    sync_timeout_ms: int = Field(default=5000, ge=100)
    in_sync_lag_max_ms: int = Field(default=10_000, ge=100, le=600_000,
                                    description="a slave not seen fetching this long leaves the in-sync set "
                                                "(only while the master and one other member stay in it)")
    dead_master_refusals: int = Field(default=2, ge=1, le=100,
                                      description="refused connects to the master before a slave reports it dead")
    wait_ms: int = Field(default=50, ge=5, le=1000, description="long-poll cap = tick state period")
    idle_wait_ms: int = Field(default=1000, ge=5, le=5000,
                              description="long-poll cap while the master's log and tick state have "
                                          "not changed beyond the clock (docs/replication.md)")
    chunk_bytes: int = Field(default=1 << 20, ge=4096, le=64 << 20)
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


class LimitsSection(_Section):
    """Limits a producer can hit (docs/api.md, "Limits"; built as ``Limits``, whose defaults
    these are) and the RPC sizes."""

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
    # as many as the delay nodes' dispatch rounds in flight (dispatch_concurrency_max): a round
    # past the window waits unread while the earlier ones wait for their fsync
    stream_window_max: int = Field(default=64, ge=1,
                                   description="requests of one SendBatchStream answered at once (in order)")
    stream_window_bytes_max: int = Field(default=64 * 1024 * 1024, ge=1,
                                         description="bytes of the requests of one SendBatchStream answered at "
                                                     "once: the next stays unread (one alone is always read)")


class StoreSection(_Section):
    """The delay store: wheel, schedule, id index, segments (built as ``StoreSettings``, whose
    defaults these are)."""

    FLAT: ClassVar[dict[str, str]] = {"dedupe_window_ms": "delay_dedupe_window_ms"}

    tick_ms: int = Field(default=S.tick_ms, ge=1)
    window_ms: int = Field(default=S.window_ms, ge=1, description="the wheel loads a second this long before it starts")
    bucket_ms: int = Field(default=S.bucket_ms, ge=1000, description="schedule bucket length (fixed at creation)")
    inflight_max: int = Field(default=S.inflight_max, ge=1, description="fired, not yet acknowledged messages")
    unfiled_max: int = Field(default=S.unfiled_max, ge=1, description="accepted, not yet filed messages")
    wheel_entries_max: int = Field(default=S.wheel_entries_max, ge=1, description="messages in the timing wheel")
    schedule_cache_bytes_max: int = Field(default=S.schedule_cache_bytes_max, ge=0,
                                          description="decoded schedule frames kept for the wheel")
    cache_ahead_ms: int = Field(default=S.cache_ahead_ms, ge=0,
                                description="frames due this far past the loaded seconds are cached when filed")
    seconds_load_max: int = Field(default=S.seconds_load_max, ge=1, description="seconds loaded from disk per poll")
    file_step_max: int = Field(default=S.file_step_max, ge=1,
                               description="records a master files per step of its filing loop (the loop yields "
                                           "to other work between steps)")
    follower_file_step_max: int = Field(default=S.follower_file_step_max, ge=1,
                                        description="records a slave files per step (it also applies replicated "
                                                    "bytes on its loop)")
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
    dedupe_window_ms: int = Field(default=S.dedupe_window_ms, ge=0,
                                  description="ids of delivered/cancelled messages kept for re-send dedupe")
    id_compact_ratio_min: float = Field(default=S.id_compact_ratio_min, gt=0, le=1)


class DelaySection(_Section):
    """The delay service around the store: checkpoints, the wheel loop, dispatch, draining."""

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
    # 200 ms: an awaited producer's calls of every 10-20 ms file about seven to a round (one
    # frame per due second for all of them), where 20 ms filed 1.3 (docs/benchmarks.md,
    # "Fourteenth session"); a record due within dispatch_lead_ms + this + 50 ms files at once
    file_linger_ms: int = Field(default=200, ge=0, le=1000,
                                description="the filer waits up to this long after a write for more to file "
                                            "together (fewer, fuller schedule frames), unless a message waiting "
                                            "is due within dispatch_lead_ms + this + 50 ms; 0: file at once")
    dispatch_batch_max: int = 10_000       # messages per dispatch RPC (a larger due batch is split)
    # dispatch rounds in flight; due messages gather while they run. A round is answered after the
    # real-time node's fsync, so rounds in flight x the round spacing (64 x 40 ms = 2.56 s) is how
    # long an fsync there may stall before delivery waits for it (2 gave the 100-600 ms tail of
    # issue 28 whenever this VM's disk took 100+ ms; 16 ran out under load in a 1 s stall:
    # docs/benchmarks.md "A slow fsync at the real-time node")
    dispatch_concurrency_max: int = Field(default=64, ge=1, le=256,
                                          description="dispatch rounds in flight (each answered after the "
                                                      "real-time node's fsync); the real-time nodes' "
                                                      "stream_window_max should be at least this")
    # firing rounds at least this far apart (batches under load); with the lead below, a round
    # leaves 20-60 ms before its messages are due, so the interval costs no lateness (a message
    # filed too late for the spacing fires a round at once: DelayNode._wheel_loop), and each
    # round (one stream message each way, ~220 us of CPU per side: bench/bench_grpc.py) carries
    # more (issue 28: 3 -> 7 -> 20 -> 40 ms with the lead 15 -> 30 -> 60 ms, docs/benchmarks.md
    # "Fewer, fuller rounds", "Where a node's CPU goes at a low rate", "Fewer rounds, fewer filings")
    dispatch_round_interval_ms: int = 40
    dispatch_round_interval_busy_ms: int = 40  # ... and this far after a round of dispatch_round_busy_messages or more
    dispatch_round_busy_messages: int = 32
    dispatch_lead_ms: int = Field(default=60, ge=0, le=1000,
                                  description="a firing round takes messages due this far ahead; the real-time "
                                              "node holds them until due (must stay below visible_hold_ms_max)")
    dispatch_attempts_max: int = 8         # permanent errors: dead letter after this many tries
    dispatch_backoff_ms_max: int = 2000
    # draining the group (`hourglass admin drain`, docs/design.md "Draining a delay group")
    drain_poll_ms: int = Field(default=1000, ge=50, le=60_000,
                               description="a draining delay master moves a round of its pending messages "
                                           "and asks the meta servers again this often")
    drain_idle_poll_ms: int = Field(default=5000, ge=50, le=600_000,
                                    description="a delay master whose group does not drain asks this often "
                                                "(a slave never asks: it starts asking when promoted)")
    drain_horizon_ms: int = Field(default=5000, ge=1000, le=600_000,
                                  description="a draining group fires messages due within this long itself "
                                              "instead of moving them (the wheel's window plus a margin)")
    drain_batch_max: int = Field(default=2000, ge=1, le=100_000,
                                 description="messages a draining master moves per SendBatch to another group")
    drain_round_max: int = Field(default=20_000, ge=1, le=10_000_000,
                                 description="messages a draining master moves per drain_poll_ms at most (the "
                                             "load a drain puts on the other groups)")


class RealtimeSection(_Section):
    """The real-time store (built as ``RealtimeSettings``, whose defaults these are) and the
    real-time service: pulls, subjects and their quotas."""

    FLAT: ClassVar[dict[str, str]] = {"segment_bytes": "realtime_segment_bytes",
                                      "retention_ms": "realtime_retention_ms",
                                      "retention_bytes": "realtime_retention_bytes",
                                      "frame_cache_bytes_max": "realtime_frame_cache_bytes_max"}

    segment_bytes: int = Field(default=R.segment_bytes, ge=4096)
    retention_ms: int = Field(default=R.retention_ms, ge=0, description="consumed real-time segments kept")
    retention_bytes: int = Field(default=R.retention_bytes, ge=0, description="0 = no size trigger")
    group_idle_ms_max: int = Field(default=R.group_idle_ms_max, ge=1000,
                                   description="a consumer group idle this long stops holding data back")
    index_compact_entries_min: int = Field(default=R.index_compact_entries_min, ge=1,
                                           description="dead index entries before a subject's index is rewritten")
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
                                                        "first index entries for; a send with more is stored as "
                                                        "several frames, the loop serving other calls between them")
    subjects_per_frame_max: int = Field(default=128, ge=1,
                                        description="subjects one frame (one step of the event loop) writes index "
                                                    "entries for; a send of more is stored as several frames")
    groups_max: int = Field(default=R.groups_max, ge=1)
    pull_scan_entries_max: int = Field(default=R.pull_scan_entries_max, ge=1,
                                       description="index entries one pull may examine (tag filters skip entries)")
    index_files_open_max: int = Field(default=R.index_files_open_max, ge=1)
    frame_cache_bytes_max: int = Field(default=R.frame_cache_bytes_max, ge=0,
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


class DiskSection(_Section):
    """Disk lifecycle (docs/operations.md "Disk", rules in node/store/diskspace.py): a write is
    admitted only if it leaves min(free_min_bytes, free_min_ratio x disk size) free; once
    refusing, writes resume above that mark plus min(resume_margin_ratio x disk size,
    resume_margin_bytes_max). The watermark is built as a ``DiskWatermark`` (defaults:
    ``DISK_DEFAULTS``); the section also says how often free space is read and retention runs."""

    FLAT: ClassVar[dict[str, str]] = {"free_min_bytes": "disk_free_min_bytes", "free_min_ratio": "disk_free_min_ratio",
                                      "resume_margin_ratio": "disk_resume_margin_ratio",
                                      "resume_margin_bytes_max": "disk_resume_margin_bytes_max",
                                      "check_interval_ms": "disk_check_interval_ms"}

    free_min_bytes: int = Field(default=W.free_min_bytes, ge=0, description="the mark: free bytes writes never take")
    free_min_ratio: float = Field(default=W.free_min_ratio, ge=0, le=0.9,
                                  description="... or this share of the disk, whichever is smaller")
    resume_margin_ratio: float = Field(default=W.resume_margin_ratio, ge=0, le=0.5,
                                       description="writes resume at the mark plus this share of the disk ...")
    resume_margin_bytes_max: int = Field(default=W.resume_margin_bytes_max, ge=0,
                                         description="... or this many bytes, whichever is smaller")
    check_interval_ms: int = Field(default=1000, ge=10, description="free space is read this often")
    retention_interval_ms: int = Field(default=10_000, ge=10, description="how often retention runs")


class ScrubSection(_Section):
    """Scrubbing and verify (docs/operations.md "Self-healing and scrubbing"; built as
    ``ScrubSettings``, whose defaults these are)."""

    FLAT: ClassVar[dict[str, str]] = {"rate_mib_s": "scrub_rate_mib_s", "step_bytes_max": "scrub_step_bytes_max",
                                      "pass_interval_ms": "scrub_pass_interval_ms"}

    rate_mib_s: float = Field(default=C.rate_mib_s, ge=0, description="background CRC re-check rate; 0 = off")
    step_bytes_max: int = Field(default=C.step_bytes_max, ge=4096, description="bytes read per scrub step")
    pass_interval_ms: int = Field(default=C.pass_interval_ms, ge=0,
                                  description="a scrub pass starts at least this long after the previous one")
    verify_rate_mib_s: float = Field(default=C.verify_rate_mib_s, gt=0,
                                     description="read rate of `hourglass admin verify`")


class StatusSection(_Section):
    """What Admin/Status reports for the console (docs/console.md, "Node-side support")."""

    FLAT: ClassVar[dict[str, str]] = {"buckets_max": "status_buckets_max", "subjects_max": "status_subjects_max",
                                      "groups_max": "status_groups_max"}

    buckets_max: int = Field(default=20_000, ge=1,
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
    subjects_max: int = Field(default=20, ge=1, le=1000,
                              description="subjects a delay Status names in pending_subjects (most "
                                          "pending first; the rest summed as \"(other)\")")
    groups_max: int = Field(default=1000, ge=1,
                            description="(subject, consumer group) rows one real-time Status carries at most")


class LoopSection(_Section):
    """The event-loop watchdog: stalls logged (node/aio.py ``StallWatch``), and the registration
    given up by a wedged node (node/registration.py)."""

    FLAT: ClassVar[dict[str, str]] = {"stall_report_ms": "loop_stall_report_ms", "stall_max_ms": "loop_stall_max_ms"}

    stall_report_ms: int = Field(default=200, ge=0,
                                 description="log each event-loop stall this long or longer, with its "
                                             "duration and where the loop was (0 = off)")
    stall_max_ms: int = Field(default=8000, ge=500, le=300_000,
                              description="the heartbeat thread stops renewing the registration while the "
                                          "event loop has not turned for this long: a wedged node gives up "
                                          "its lease (and a master its seat)")


class ClockSection(_Section):
    """The node's clock: tests inject skew; ``allow_control`` lets an admin call move it forward."""

    FLAT: ClassVar[dict[str, str]] = {"offset_ms": "clock_offset_ms", "allow_control": "allow_clock_control"}

    offset_ms: int = 0
    allow_control: bool = False


# the tree's sections, in the order docs/settings.md lists them
TREE: dict[str, type[_Section]] = {
    "server": ServerSection, "meta": MetaSection, "replication": ReplicationSection, "limits": LimitsSection,
    "store": StoreSection, "delay": DelaySection, "realtime": RealtimeSection, "disk": DiskSection,
    "scrub": ScrubSection, "status": StatusSection, "loop": LoopSection, "clock": ClockSection}


def _flat_names() -> dict[str, tuple[str, str]]:
    """Every setting's flat name -> (section, field); one path per name, one name per path."""
    out: dict[str, tuple[str, str]] = {}
    for section, cls in TREE.items():
        assert set(cls.FLAT) <= set(cls.model_fields), f"{cls.__name__}.FLAT renames a field it does not have"
        for field in cls.model_fields:
            flat = cls.FLAT.get(field, field)
            assert flat not in out, f"flat name {flat} is both {'.'.join(out[flat])} and {section}.{field}"
            assert flat not in TREE, f"flat name {flat} is also a section's name"
            out[flat] = (section, field)
    return out


FLAT_NAMES = _flat_names()

# The storage sections the stores and cores take: built from the tree's section of the same name
# (``NodeSettings.section``); their defaults are written in their class (node/store/settings.py,
# cluster/codec.py for Limits), the section's field refers to them.
SECTIONS = {"store": StoreSettings, "realtime": RealtimeSettings, "scrub": ScrubSettings, "disk": DiskWatermark,
            "limits": Limits}
SECTION_DEFAULTS = {"store": S, "realtime": R, "scrub": C, "disk": W, "limits": DEFAULT_LIMITS}


def _nest(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with its flat keys moved to their sections (a flat key wins over the same
    setting given nested)."""
    out = dict(data)
    for key in [k for k in out if k in FLAT_NAMES]:
        section, field = FLAT_NAMES[key]
        given = out.get(section, {})
        given = given.model_dump() if isinstance(given, BaseModel) else dict(given)
        given[field] = out.pop(key)
        out[section] = given
    return out


class FlatEnvSource(PydanticBaseSettingsSource):
    """``HOURGLASS_<FLAT>`` variables (the names deployments hold), nested into their sections.
    A list setting is JSON (``HOURGLASS_META_SERVERS='["a:1","b:2"]'``), as before."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # not asked field by field: __call__ reads them all

    def __call__(self) -> dict[str, Any]:
        env = {k.upper(): v for k, v in os.environ.items() if k.upper().startswith(ENV_PREFIX)}
        out: dict[str, dict[str, Any]] = {}
        for flat, (section, field) in FLAT_NAMES.items():
            value = env.get(ENV_PREFIX + flat.upper())
            if value is None:
                continue
            if get_origin(TREE[section].model_fields[field].annotation) is list:
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:  # left as text: validation names the setting and wants a list
                    pass
            out.setdefault(section, {})[field] = value
        return out


class NodeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid")

    server: ServerSection = ServerSection()
    meta: MetaSection = MetaSection()
    replication: ReplicationSection = ReplicationSection()
    limits: LimitsSection = LimitsSection()
    store: StoreSection = StoreSection()
    delay: DelaySection = DelaySection()
    realtime: RealtimeSection = RealtimeSection()
    disk: DiskSection = DiskSection()
    scrub: ScrubSection = ScrubSection()
    status: StatusSection = StatusSection()
    loop: LoopSection = LoopSection()
    clock: ClockSection = ClockSection()

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return init_settings, FlatEnvSource(settings_cls), env_settings, dotenv_settings, file_secret_settings

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_names(cls, data: Any) -> Any:
        return _nest(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _lead_within_hold(self) -> "NodeSettings":
        """A real-time node holds a message stored ahead of its due time at most
        ``visible_hold_ms_max``: a longer lead would deliver messages early."""
        lead, hold = self.delay.dispatch_lead_ms, self.realtime.visible_hold_ms_max
        if lead >= hold and lead > 0:
            raise ValueError(f"dispatch_lead_ms ({lead}) must be below visible_hold_ms_max "
                             f"({hold}): real-time nodes would hand messages out early")
        return self

    def replace(self, **values: Any) -> "NodeSettings":
        """A validated copy with ``values`` (flat names or whole sections) changed; no
        environment is read."""
        return type(self).model_validate({**dict(self), **values})

    def section(self, name: str):
        """The storage section ``name`` of ``SECTIONS`` (the dataclass a store or core takes),
        built from the tree's section of that name; ``limits`` from the ``limits`` section."""
        cls = SECTIONS[name]
        mine = getattr(self, name)
        values = {f: getattr(mine, f) for f in cls.__dataclass_fields__ if f != "limits"}
        if "limits" in cls.__dataclass_fields__:
            values["limits"] = self.section("limits")
        return cls(**values)

    def store_settings(self) -> StoreSettings:
        return self.section("store")

    def realtime_settings(self) -> RealtimeSettings:
        return self.section("realtime")

    def disk_watermark(self) -> DiskWatermark:
        return self.section("disk")
