"""Settings of one meta server process (prefix ``HOURGLASS_META_``): every default of the
meta server written once. ``META_DEFAULTS`` is the model with its defaults only (no
environment read): the pieces tests build alone (``EtcdClient``, ``Election``) refer to it."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cluster import quota as Q
from cluster.security import all_or_none


class MetaSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HOURGLASS_META_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port; 0 = pick a free one")
    advertise: str | None = None
    health_port: int | None = Field(default=None, ge=0, le=65535,
                                    description="plaintext grpc.health.v1 only, for Kubernetes probes (TLS on `port`)")
    etcd_endpoints: list[str] = ["127.0.0.1:2379"]
    etcd_timeout_ms: int = Field(default=2000, ge=100)
    # mutual TLS to etcd (docs/security.md): etcd's CA, and this meta server's client certificate
    etcd_ca_file: Path | None = None
    etcd_cert_file: Path | None = None
    etcd_key_file: Path | None = None
    node_ttl_ms: int = Field(default=5000, ge=2000, le=300_000, description="default node lease TTL")
    campaign_wait_ms_max: int = Field(default=30_000, ge=0)
    routes_new_per_minute_max: int = Field(default=Q.NEW_PER_MINUTE_MAX_DEFAULT, ge=1,
                                           description="new subject routes one principal may create per minute at "
                                                       "this meta server (docs/security.md \"Subject quotas\")")
    route_creations_max: int = Field(default=16, ge=1, description="route creations waiting on etcd at once")
    health_check_interval_ms: int = Field(default=1000, ge=100)
    leader_wait_ms_max: int = Field(default=2000, ge=0, le=30_000,
                                    description="a Leader long poll waits at most this long for the leader key or "
                                                "the in-sync set to change (docs/replication.md \"Leader long poll\")")
    leader_waits_max: int = Field(default=1024, ge=0,
                                  description="Leader long polls waiting at once; beyond it a Leader call is "
                                              "answered at once (the caller polls)")
    ready_file: Path | None = None
    log_level: str = "INFO"
    # the /metrics endpoint (docs/operations.md "Metrics endpoint"): off unless metrics_port is set;
    # where it listens (the chart: the pod IP), optionally HTTPS and a bearer token
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="Prometheus port; 0 = free one")
    metrics_host: str = Field(default="127.0.0.1", description="address the metrics endpoint binds")
    metrics_tls_cert_file: Path | None = None
    metrics_tls_key_file: Path | None = None
    metrics_token_file: Path | None = Field(default=None, description="scrapes must send this bearer token")

    @model_validator(mode="after")
    def _etcd_tls_all_or_none(self) -> "MetaSettings":
        all_or_none(self, "HOURGLASS_META_", ("etcd_ca_file", "etcd_cert_file", "etcd_key_file"),
                    "TLS to etcd needs all of {}")
        return self

    def node_ttl_s(self) -> int:
        """The lease TTL of a node that asks for none, in whole seconds (rounded up)."""
        return -(-self.node_ttl_ms // 1000)


META_DEFAULTS = MetaSettings.model_construct()  # the defaults alone: no environment, no validation
