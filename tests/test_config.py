"""node/config.py: one nested settings tree. Every setting has one path
(``settings.store.tick_ms``) and one flat name (``HOURGLASS_TICK_MS``), the name deployments
already hold; the storage sections' defaults are written once (node/store/settings.py), and
the sections a node builds for its stores carry what was set."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from node.config import FLAT_NAMES, SECTION_DEFAULTS, SECTIONS, TREE, NodeSettings

# every flat name a node read before the tree was nested (issue 29): the chart, dev clusters and
# operators set them as HOURGLASS_<NAME>; each must still set one setting
DEPLOYED = """
    role node_id group data_dir host port metrics_port metrics_host metrics_tls_cert_file metrics_tls_key_file
    metrics_token_file health_port advertise ready_file realtime_nodes delay_nodes meta_servers
    meta_lease_ttl_ms meta_heartbeat_ms meta_timeout_ms meta_refresh_ms replicated ack_mode sync_timeout_ms
    in_sync_lag_max_ms dead_master_refusals replication_wait_ms replication_idle_wait_ms replication_chunk_bytes
    campaign_step_ms min_term_ms leader_poll_ms leader_wait_ms ack_journal payload_bytes_max subject_bytes_max
    id_bytes_max delay_horizon_ms batch_messages_max batch_bytes_max tags_max tag_bytes_max properties_max
    property_key_bytes_max property_value_bytes_max request_bytes_max loop_stall_report_ms loop_stall_max_ms
    stream_window_max stream_window_bytes_max tick_ms window_ms bucket_ms checkpoint_interval_ms checkpoint_idle_interval_ms
    wheel_idle_wait_ms_max iterate_interval_ms file_linger_ms dispatch_batch_max dispatch_concurrency_max
    dispatch_round_interval_ms dispatch_round_interval_busy_ms dispatch_round_busy_messages dispatch_lead_ms
    dispatch_attempts_max dispatch_backoff_ms_max drain_poll_ms drain_idle_poll_ms drain_horizon_ms drain_batch_max
    drain_round_max
    inflight_max unfiled_max wheel_entries_max schedule_cache_bytes_max cache_ahead_ms seconds_load_max
    file_step_max follower_file_step_max frame_bytes_max verify_ahead_ms subject_table_stale_entries_max
    subject_tables_per_checkpoint_max message_segment_bytes dispatch_segment_bytes schedule_segment_bytes
    id_entries_max id_slots disk_free_min_bytes disk_free_min_ratio disk_resume_margin_ratio
    disk_resume_margin_bytes_max disk_check_interval_ms retention_interval_ms delay_dedupe_window_ms
    id_compact_ratio_min realtime_retention_ms realtime_retention_bytes realtime_segment_bytes group_idle_ms_max
    index_compact_entries_min dedup_window_ms dedup_entries_max ack_timeout_ms inflight_per_group_max pull_max
    pull_wait_ms_max max_attempts auto_create_subjects subjects subjects_max subjects_new_per_minute_max
    subjects_owned_max subjects_round_max subjects_new_per_frame_max subjects_per_frame_max groups_max
    pull_scan_entries_max index_files_open_max realtime_frame_cache_bytes_max offsets_compact_bytes
    checkpoint_bytes_min checkpoint_index_fsyncs_max visible_hold_ms_max visible_step_ms status_buckets_max
    pending_by_minute_horizon_ms pending_by_minute_buckets_max lateness_window_ms lateness_slot_ms
    master_changes_window_ms master_changes_kept_max status_subjects_max status_groups_max clock_offset_ms
    allow_clock_control scrub_rate_mib_s scrub_step_bytes_max scrub_pass_interval_ms verify_rate_mib_s log_level
""".split()


def _other(value):
    """Another valid value than ``value``."""
    return (not value) if isinstance(value, bool) else value * 2 if isinstance(value, int) else value / 2


def _env(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_flat_name_sets_one_setting_and_every_setting_has_one():
    assert set(DEPLOYED) == set(FLAT_NAMES), "a deployed name is gone, or a new setting has no flat name listed"
    paths = [(section, field) for section, cls in TREE.items() for field in cls.model_fields]
    assert sorted(FLAT_NAMES.values()) == sorted(paths)  # onto: every setting has a name ...
    assert len(set(FLAT_NAMES.values())) == len(FLAT_NAMES)  # ... and one only
    assert set(NodeSettings.model_fields) == set(TREE)  # nothing outside a section


def test_the_tree_is_read_by_path_only():
    s = NodeSettings()
    assert s.store.tick_ms == SECTION_DEFAULTS["store"].tick_ms
    assert not hasattr(s, "tick_ms")  # no flat attributes: code reads the path


def test_every_section_has_its_defaults_object():
    assert set(SECTION_DEFAULTS) == set(SECTIONS)
    assert all(isinstance(SECTION_DEFAULTS[name], cls) for name, cls in SECTIONS.items())


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_section_setting_has_one_default_and_can_be_set(monkeypatch, section):
    cls, defaults = SECTIONS[section], SECTION_DEFAULTS[section]
    flat = {path: name for name, path in FLAT_NAMES.items()}
    fields = [f for f in dataclasses.fields(cls) if f.name != "limits"]
    built = NodeSettings().section(section)
    for f in fields:
        assert getattr(built, f.name) == getattr(defaults, f.name), f"{f.name}: NodeSettings has another default"
    for f in fields:
        assert (section, f.name) in flat, f"{f.name} cannot be set (no NodeSettings.{section}.{f.name})"
        monkeypatch.setenv(f"HOURGLASS_{flat[section, f.name].upper()}", _env(_other(getattr(defaults, f.name))))
    built = NodeSettings().section(section)
    for f in fields:
        assert getattr(built, f.name) == _other(getattr(defaults, f.name)), \
            f"HOURGLASS_{flat[section, f.name].upper()} did not reach {f.name}"


def test_limits_reach_both_stores(monkeypatch):
    monkeypatch.setenv("HOURGLASS_PAYLOAD_BYTES_MAX", "1234")
    n = NodeSettings()
    assert n.store_settings().limits.payload_bytes_max == n.realtime_settings().limits.payload_bytes_max == 1234


def test_flat_and_nested_environment(monkeypatch):
    monkeypatch.setenv("HOURGLASS_REALTIME_RETENTION_MS", "5000")
    monkeypatch.setenv("HOURGLASS_META_SERVERS", '["10.0.0.5:7100", "10.0.0.6:7100"]')
    monkeypatch.setenv("HOURGLASS_REPLICATED", "true")
    monkeypatch.setenv("HOURGLASS_DATA_DIR", "/var/lib/hourglass")
    monkeypatch.setenv("HOURGLASS_DELAY__DRAIN_POLL_MS", "300")  # the nested form
    monkeypatch.setenv("HOURGLASS_STORE__TICK_MS", "20")
    monkeypatch.setenv("HOURGLASS_TICK_MS", "5")  # the flat name wins over the nested one
    s = NodeSettings()
    assert s.realtime.retention_ms == 5000 and s.meta.servers == ["10.0.0.5:7100", "10.0.0.6:7100"]
    assert s.replication.enabled and str(s.server.data_dir) == "/var/lib/hourglass"
    assert (s.delay.drain_poll_ms, s.store.tick_ms) == (300, 5)
    assert NodeSettings(tick_ms=7).store.tick_ms == 7  # an argument wins over the environment


def test_flat_and_nested_arguments():
    flat = NodeSettings(role="realtime", tick_ms=7, realtime_retention_ms=9, meta_servers=["a:1"])
    nested = NodeSettings(server={"role": "realtime"}, store={"tick_ms": 7}, realtime={"retention_ms": 9},
                          meta={"servers": ["a:1"]})
    assert flat == nested
    assert NodeSettings(store={"tick_ms": 3, "window_ms": 700}, tick_ms=4).store.window_ms == 700  # merged
    with pytest.raises(ValidationError, match="realtime_retention"):
        NodeSettings(realtime_retention=1)  # no such name: refused, as before
    with pytest.raises(ValidationError):
        NodeSettings(tick_ms=0)  # the bounds hold for flat names too


def test_replace_is_a_validated_copy(monkeypatch):
    s = NodeSettings(node_id="d1", subjects_per_frame_max=5)
    monkeypatch.setenv("HOURGLASS_NODE_ID", "from-env")
    t = s.replace(index_files_open_max=16)
    assert (t.realtime.index_files_open_max, t.realtime.subjects_per_frame_max, t.server.node_id) == (16, 5, "d1")
    assert s.realtime.index_files_open_max == SECTION_DEFAULTS["realtime"].index_files_open_max
    with pytest.raises(ValidationError):
        s.replace(dispatch_lead_ms=500)  # the cross-section check runs again


def test_a_flat_list_that_is_not_json_is_refused_naming_the_setting(monkeypatch):
    """``HOURGLASS_META_SERVERS=a:1`` (not a JSON list) is a validation error on
    ``meta.servers``, which ``hourglass node`` says in one line, not a JSONDecodeError."""

    monkeypatch.setenv("HOURGLASS_META_SERVERS", "127.0.0.1:7000")
    with pytest.raises(ValidationError) as e:
        NodeSettings()
    assert [x["loc"] for x in e.value.errors()] == [("meta", "servers")]
    monkeypatch.setenv("HOURGLASS_META_SERVERS", '["127.0.0.1:7000"]')
    assert NodeSettings().meta.servers == ["127.0.0.1:7000"]
