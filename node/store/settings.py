"""The storage sections of a node's settings tree: the delay store with its timing wheel,
schedule log and id index (``StoreSettings``), the real-time store (``RealtimeSettings``) and
the scrub (``ScrubSettings``), the disk watermark (``DISK_DEFAULTS``, a
``node.store.diskspace.DiskWatermark``). Each default is written here once; the producer
limits' (``Limits``) are written in ``cluster/codec.py``, shared with the SDK.

``node.config.NodeSettings`` (the process's settings, ``HOURGLASS_*``) is the root of the tree:
its sections of the same names (``store``, ``realtime``, ``scrub``, ``disk``) take their
defaults from here, and it builds these objects from them (``section(name)``,
``store_settings()``, ``realtime_settings()``, ``disk_watermark()``). The pure cores that tests
construct directly (``TimingWheel``, ``ScheduleLog``, ``IdIndex``, ``SegmentedLog``,
``ScrubPlan``) take these values as arguments; a default they have refers to ``STORE_DEFAULTS``
/ ``SCRUB_DEFAULTS``, never a second literal (tests/test_settings_tree.py keeps it so)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.logformat import BUCKET_MS_DEFAULT  # shared with the Spark reader, without loading the node
from node.store.diskspace import DiskWatermark
from node.store.records import Limits


@dataclass(frozen=True, slots=True)
class StoreSettings:
    tick_ms: int = 10
    window_ms: int = 500
    bucket_ms: int = BUCKET_MS_DEFAULT
    message_segment_bytes: int = 64 * 1024 * 1024
    dispatch_segment_bytes: int = 16 * 1024 * 1024
    schedule_segment_bytes: int = 256 * 1024 * 1024
    schedule_cache_bytes_max: int = 32 * 1024 * 1024  # decoded schedule frames kept for the wheel
    cache_ahead_ms: int = 10_000          # frames due this far past the loaded seconds are cached when filed
    wheel_entries_max: int = 2_000_000
    unfiled_max: int = 1_000_000          # accepted but not yet iterated into the schedule log
    inflight_max: int = 100_000           # fired but not yet acknowledged by the real-time side
    seconds_load_max: int = 64            # seconds loaded from disk per poll (catch-up is gradual)
    file_step_max: int = 2_000            # records a master files per step of its filing loop (it yields between steps:
                                          # 2,000 is a few ms of the loop; docs/benchmarks.md, "Filing steps")
    follower_file_step_max: int = 5_000   # the same on a slave, which also applies replicated bytes on its loop
    frame_bytes_max: int = 4 * 1024 * 1024  # a batch larger than this is appended as several frames
    id_slots: int = 1 << 20
    id_entries_max: int = 4 << 20
    verify_ahead_ms: int = 10_000         # at open, frames due in [completed_ms, +this] are verified (heal.py)
    # per-bucket subject tables (node/delay/subject_tables.py): a checkpoint writes a bucket's table
    # once this many index entries were filed since it was last written (a restart reads the
    # frames of at most that many entries per bucket), at most so many tables per checkpoint
    subject_table_stale_entries_max: int = 64
    subject_tables_per_checkpoint_max: int = 16
    limits: Limits = field(default_factory=Limits)
    # retention (node/delay/retention.py): ids of delivered/cancelled messages stay this long
    # after their bucket ended, so a re-send is still a duplicate; a sealed id file is
    # rewritten once this share of its entries may go
    dedupe_window_ms: int = 7 * 86_400_000
    id_compact_ratio_min: float = 0.5


@dataclass(frozen=True, slots=True)
class RealtimeSettings:
    segment_bytes: int = 64 * 1024 * 1024
    dedup_window_ms: int = 600_000          # de-duplicate by (subject, message id) within this window
    dedup_entries_max: int = 2_000_000      # dedup map size; new messages beyond it are answered OVERLOADED
    ack_timeout_ms: int = 30_000            # a pulled, unacked message is redelivered after this
    inflight_per_group_max: int = 100_000   # in-flight handles per (subject, group); pull stops handing out
    pull_max: int = 1000                    # max_messages above this is clamped
    auto_create_subjects: bool = True
    max_attempts: int = 16                  # nack: after this many attempts -> dead letter (used by the service)
    limits: Limits = field(default_factory=Limits)
    subjects_max: int = 10_000              # known subjects (each costs a little RAM and an index file)
    groups_max: int = 100_000               # consumer groups over all subjects
    pull_scan_entries_max: int = 65_536     # index entries one pull may examine (tag filters skip entries)
    # open index file descriptors (LRU; node/server.py raises RLIMIT_NOFILE to fit): a send over
    # more subjects than this reopens index files on the event loop (issue 27: 40 us each)
    index_files_open_max: int = 4096
    frame_cache_bytes_max: int = 64 * 1024 * 1024  # decoded recent frames kept for pulls (LRU, by body bytes)
    offsets_compact_bytes: int = 16 * 1024 * 1024  # offsets log bytes past its last snapshot before compaction
    checkpoint_bytes_min: int = 4 * 1024 * 1024  # a periodic flush checkpoints the index after this many log bytes
    # index files (and new index folders) a periodic checkpoint fsyncs at most, oldest unsynced
    # entries first; it then vouches only below the rest (issue 27: a flood of new subjects
    # would otherwise fsync one file and one folder per subject in one burst)
    checkpoint_index_fsyncs_max: int = 64
    # retention (node/realtime/retention.py): a sealed segment every group is past goes once it is
    # older than retention_ms or the log is over retention_bytes (0 = no size limit); a group that
    # has not pulled or acked for group_idle_ms_max stops holding segments back
    retention_ms: int = 3_600_000
    retention_bytes: int = 0
    group_idle_ms_max: int = 7 * 86_400_000
    index_compact_entries_min: int = 4096       # dead index entries before a subject's file is rewritten
    # a message stored with a due time ahead (a delay node's firing round, dispatch_lead_ms) is
    # handed out at that time, held at most this long after it was stored
    visible_hold_ms_max: int = 100
    visible_step_ms: int = 4                # ... at its due time rounded up to a multiple of this


@dataclass(frozen=True, slots=True)
class ScrubSettings:
    """The background CRC re-check (node/store/scrub.py) and ``hourglass admin verify``."""

    rate_mib_s: float = 4.0               # background re-check rate; 0 = no background scrub
    step_bytes_max: int = 1 << 20         # bytes read per scrub step
    pass_interval_ms: int = 60_000        # a pass starts at least this long after the previous one did
    verify_rate_mib_s: float = 64.0       # read rate of an online ``admin verify``

    @property
    def rate_bytes_per_s(self) -> int:
        return int(self.rate_mib_s * (1 << 20))


STORE_DEFAULTS = StoreSettings()
REALTIME_DEFAULTS = RealtimeSettings()
SCRUB_DEFAULTS = ScrubSettings()
# disk lifecycle (docs/operations.md "Disk", rules in node/store/diskspace.py): a write is admitted
# only if it leaves min(free_min_bytes, free_min_ratio x disk size) free; once refusing, writes
# resume above that mark plus min(resume_margin_ratio x disk size, resume_margin_bytes_max)
DISK_DEFAULTS = DiskWatermark(free_min_bytes=2 << 30, free_min_ratio=0.05, resume_margin_ratio=0.02,
                              resume_margin_bytes_max=64 << 20)
