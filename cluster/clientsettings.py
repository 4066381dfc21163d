"""The SDK's settings: one typed model (``ClientSettings``), environment prefix
``HOURGLASS_CLIENT_``, where every default of ``Producer``, ``Consumer`` and
``MetaResolver`` is written once.

The tree::

    ClientSettings
      calls      CallSettings       deadlines and retry backoff, shared by producers and consumers
      producer   ProducerSettings   batching and queueing of sends
      consumer   ConsumerSettings   pulls, acks, nacks
      discovery  DiscoverySettings  meta server calls and the route cache
      limits     Limits             what a node accepts (cluster/codec.py; checked before sending)

The SDK's constructors keep their keyword arguments (``Producer(resolver, linger_ms=5)``);
each default refers to ``CLIENT_DEFAULTS`` (the model with its defaults only, no environment
read), never a second literal. ``Producer.from_settings`` / ``Consumer.from_settings`` /
``MetaResolver.from_settings`` build one from a whole tree::

    s = ClientSettings()                       # HOURGLASS_CLIENT_PRODUCER__LINGER_MS=5 ...
    resolver = MetaResolver.from_settings(["127.0.0.1:7100"], s)
    producer = Producer.from_settings(resolver, s)

The node's own client settings (``meta_timeout_ms``, ``meta_refresh_ms``) take their
defaults from ``DiscoverySettings``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cluster.codec import DEFAULT_LIMITS, Limits

MIB = 1 << 20
ACK_LINGER_MS_MAX = 10_000  # the most ``ack_linger_ms`` may be
LOOKAHEAD_MS_MAX = 100      # the most ``lookahead_ms`` may be (the nodes cut a pull's lookahead to it too)


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CallSettings(_Section):
    timeout_s: float = Field(default=10.0, gt=0, description="deadline of one request (a pull: plus its wait_ms)")
    call_timeout_s: float = Field(default=30.0, gt=0,
                                  description="deadline of one SDK call, its retries included")
    backoff_ms_min: int = Field(default=25, ge=1, description="first pause between retries")
    backoff_ms_max: int = Field(default=2000, ge=1, description="longest pause between retries")


class ProducerSettings(_Section):
    linger_ms: int = Field(default=2, ge=0, description="a send waits this long for others to share its request")
    # messages per wire batch: calls queued together share one request, and a request costs
    # the delay node about as much gRPC work for 4,000 messages as for 1,000 (phase 1 of
    # docs/benchmarks.md, 1,000 per call: ~190,000 accepted msgs/s with 1,000 per request,
    # ~250,000 with 4,000). At low rates a request carries what ``linger_ms`` gathered.
    batch_max: int = Field(default=4000, ge=1, description="messages per wire batch")
    batch_bytes_max: int = Field(default=32 * MIB, ge=1, description="bytes per wire batch (estimated)")
    inflight_max: int = Field(default=8, ge=1, description="wire batches in flight at once")
    queue_max: int = Field(default=100_000, ge=1, description="messages queued, not yet answered")
    retries_max: int = Field(default=50, ge=0, description="retries of one wire batch")


class ConsumerSettings(_Section):
    batch_max: int = Field(default=500, ge=1, description="messages one pull asks for")
    wait_ms: int = Field(default=1000, ge=0, description="a pull waits this long for messages")
    ack_linger_ms: int = Field(default=20, ge=0, le=ACK_LINGER_MS_MAX,
                               description="a pipelined ack no pull took within this long gets an Ack call "
                                           "of its own")
    nack_retry_after_ms: int = Field(default=1000, ge=0, description="a nacked message is redelivered after this")
    lookahead_ms: int = Field(default=60, ge=0, le=LOOKAHEAD_MS_MAX,
                              description="the iterators (batches(), async for) take messages due within this "
                                          "long and hand each out at its due time; 0: only what is due")


class DiscoverySettings(_Section):
    meta_timeout_ms: int = Field(default=2000, ge=100, description="deadline of one meta server call")
    refresh_ms: int = Field(default=5000, ge=100, description="routes are asked again after this long")
    refresh_min_ms: int = Field(default=200, ge=0, description="a stale route is asked again at most this often")
    routes_max: int = Field(default=100_000, ge=1, description="subject routes cached (LRU)")


class ClientSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HOURGLASS_CLIENT_", env_nested_delimiter="__", extra="forbid",
                                      frozen=True)

    calls: CallSettings = CallSettings()
    producer: ProducerSettings = ProducerSettings()
    consumer: ConsumerSettings = ConsumerSettings()
    discovery: DiscoverySettings = DiscoverySettings()
    limits: Limits = DEFAULT_LIMITS


CLIENT_DEFAULTS = ClientSettings.model_construct()  # the defaults alone: no environment, no validation
