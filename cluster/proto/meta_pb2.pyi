from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[Kind]
    DELAYED_PRODUCER: _ClassVar[Kind]
    IMMEDIATE_PRODUCER: _ClassVar[Kind]
    CONSUMER: _ClassVar[Kind]
KIND_UNSPECIFIED: Kind
DELAYED_PRODUCER: Kind
IMMEDIATE_PRODUCER: Kind
CONSUMER: Kind

class NodeInfo(_message.Message):
    __slots__ = ("role", "group", "node_id", "address", "master", "offsets", "lag_ms", "lag_bytes", "epoch", "updated_ms")
    class OffsetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LAG_MS_FIELD_NUMBER: _ClassVar[int]
    LAG_BYTES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UPDATED_MS_FIELD_NUMBER: _ClassVar[int]
    role: str
    group: str
    node_id: str
    address: str
    master: bool
    offsets: _containers.ScalarMap[str, int]
    lag_ms: int
    lag_bytes: int
    epoch: int
    updated_ms: int
    def __init__(self, role: _Optional[str] = ..., group: _Optional[str] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., master: _Optional[bool] = ..., offsets: _Optional[_Mapping[str, int]] = ..., lag_ms: _Optional[int] = ..., lag_bytes: _Optional[int] = ..., epoch: _Optional[int] = ..., updated_ms: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node", "ttl_ms")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    ttl_ms: int
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class Fence(_message.Message):
    __slots__ = ("subject", "draining", "consumers", "released")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    subject: str
    draining: bool
    consumers: _containers.RepeatedScalarFieldContainer[str]
    released: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, subject: _Optional[str] = ..., draining: _Optional[bool] = ..., consumers: _Optional[_Iterable[str]] = ..., released: _Optional[_Iterable[str]] = ...) -> None: ...

class SubjectConsumers(_message.Message):
    __slots__ = ("subject", "groups")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    subject: str
    groups: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, subject: _Optional[str] = ..., groups: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("lease_id", "ttl_ms", "heartbeat_ms", "fences", "fence_revision", "watch")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    FENCES_FIELD_NUMBER: _ClassVar[int]
    FENCE_REVISION_FIELD_NUMBER: _ClassVar[int]
    WATCH_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    ttl_ms: int
    heartbeat_ms: int
    fences: _containers.RepeatedCompositeFieldContainer[Fence]
    fence_revision: int
    watch: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_id: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ..., fences: _Optional[_Iterable[_Union[Fence, _Mapping]]] = ..., fence_revision: _Optional[int] = ..., watch: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("lease_id", "node", "drained", "consumers", "watch_revision")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    WATCH_REVISION_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    node: NodeInfo
    drained: _containers.RepeatedScalarFieldContainer[str]
    consumers: _containers.RepeatedCompositeFieldContainer[SubjectConsumers]
    watch_revision: int
    def __init__(self, lease_id: _Optional[int] = ..., node: _Optional[_Union[NodeInfo, _Mapping]] = ..., drained: _Optional[_Iterable[str]] = ..., consumers: _Optional[_Iterable[_Union[SubjectConsumers, _Mapping]]] = ..., watch_revision: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("ttl_ms", "fences", "fence_revision", "watch", "consumers_merged")
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    FENCES_FIELD_NUMBER: _ClassVar[int]
    FENCE_REVISION_FIELD_NUMBER: _ClassVar[int]
    WATCH_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_MERGED_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    fences: _containers.RepeatedCompositeFieldContainer[Fence]
    fence_revision: int
    watch: _containers.RepeatedScalarFieldContainer[str]
    consumers_merged: int
    def __init__(self, ttl_ms: _Optional[int] = ..., fences: _Optional[_Iterable[_Union[Fence, _Mapping]]] = ..., fence_revision: _Optional[int] = ..., watch: _Optional[_Iterable[str]] = ..., consumers_merged: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("lease_id", "node_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    node_id: str
    def __init__(self, lease_id: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Group(_message.Message):
    __slots__ = ("role", "name", "master", "epoch", "members", "draining")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    role: str
    name: str
    master: str
    epoch: int
    members: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    draining: bool
    def __init__(self, role: _Optional[str] = ..., name: _Optional[str] = ..., master: _Optional[str] = ..., epoch: _Optional[int] = ..., members: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., draining: _Optional[bool] = ...) -> None: ...

class GetServersRequest(_message.Message):
    __slots__ = ("kind", "include_draining")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_DRAINING_FIELD_NUMBER: _ClassVar[int]
    kind: Kind
    include_draining: bool
    def __init__(self, kind: _Optional[_Union[Kind, str]] = ..., include_draining: _Optional[bool] = ...) -> None: ...

class GetServersResponse(_message.Message):
    __slots__ = ("groups", "revision")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    revision: int
    def __init__(self, groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("kind", "subject")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    kind: Kind
    subject: str
    def __init__(self, kind: _Optional[_Union[Kind, str]] = ..., subject: _Optional[str] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("group", "groups", "epoch", "draining")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    group: Group
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    epoch: int
    draining: _containers.RepeatedCompositeFieldContainer[Group]
    def __init__(self, group: _Optional[_Union[Group, _Mapping]] = ..., groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., epoch: _Optional[int] = ..., draining: _Optional[_Iterable[_Union[Group, _Mapping]]] = ...) -> None: ...

class SetRouteRequest(_message.Message):
    __slots__ = ("subject", "groups")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    subject: str
    groups: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, subject: _Optional[str] = ..., groups: _Optional[_Iterable[str]] = ...) -> None: ...

class SetRouteResponse(_message.Message):
    __slots__ = ("groups", "epoch", "previous", "changed", "draining")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    previous: _containers.RepeatedScalarFieldContainer[str]
    changed: bool
    draining: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, groups: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ..., previous: _Optional[_Iterable[str]] = ..., changed: _Optional[bool] = ..., draining: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("group", "since_ms", "changed", "others")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    OTHERS_FIELD_NUMBER: _ClassVar[int]
    group: str
    since_ms: int
    changed: bool
    others: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group: _Optional[str] = ..., since_ms: _Optional[int] = ..., changed: _Optional[bool] = ..., others: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("subject", "consumer_group")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_GROUP_FIELD_NUMBER: _ClassVar[int]
    subject: str
    consumer_group: str
    def __init__(self, subject: _Optional[str] = ..., consumer_group: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("groups", "changed")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedScalarFieldContainer[str]
    changed: bool
    def __init__(self, groups: _Optional[_Iterable[str]] = ..., changed: _Optional[bool] = ...) -> None: ...

class CampaignRequest(_message.Message):
    __slots__ = ("role", "group", "node_id", "lease_id", "wait_ms", "store_epoch_min")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    STORE_EPOCH_MIN_FIELD_NUMBER: _ClassVar[int]
    role: str
    group: str
    node_id: str
    lease_id: int
    wait_ms: int
    store_epoch_min: int
    def __init__(self, role: _Optional[str] = ..., group: _Optional[str] = ..., node_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., wait_ms: _Optional[int] = ..., store_epoch_min: _Optional[int] = ...) -> None: ...

class Leader(_message.Message):
    __slots__ = ("node_id", "address", "epoch")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    epoch: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class CampaignResponse(_message.Message):
    __slots__ = ("elected", "leader", "store_epoch", "refused")
    ELECTED_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    STORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    elected: bool
    leader: Leader
    store_epoch: int
    refused: str
    def __init__(self, elected: _Optional[bool] = ..., leader: _Optional[_Union[Leader, _Mapping]] = ..., store_epoch: _Optional[int] = ..., refused: _Optional[str] = ...) -> None: ...

class UpdateInSyncRequest(_message.Message):
    __slots__ = ("role", "group", "node_id", "epoch", "members")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    role: str
    group: str
    node_id: str
    epoch: int
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., group: _Optional[str] = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class UpdateInSyncResponse(_message.Message):
    __slots__ = ("updated", "members")
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    updated: bool
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, updated: _Optional[bool] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class ForceInSyncRequest(_message.Message):
    __slots__ = ("role", "group", "node_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    group: str
    node_id: str
    def __init__(self, role: _Optional[str] = ..., group: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class ForceInSyncResponse(_message.Message):
    __slots__ = ("previous", "members")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    previous: _containers.RepeatedScalarFieldContainer[str]
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, previous: _Optional[_Iterable[str]] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportDeadRequest(_message.Message):
    __slots__ = ("role", "group", "epoch", "reporter")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    role: str
    group: str
    epoch: int
    reporter: str
    def __init__(self, role: _Optional[str] = ..., group: _Optional[str] = ..., epoch: _Optional[int] = ..., reporter: _Optional[str] = ...) -> None: ...

class ReportDeadResponse(_message.Message):
    __slots__ = ("ended", "reason")
    ENDED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ended: bool
    reason: str
    def __init__(self, ended: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ResignRequest(_message.Message):
    __slots__ = ("role", "group", "node_id", "epoch")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    role: str
    group: str
    node_id: str
    epoch: int
    def __init__(self, role: _Optional[str] = ..., group: _Optional[str] = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ResignResponse(_message.Message):
    __slots__ = ("resigned",)
    RESIGNED_FIELD_NUMBER: _ClassVar[int]
    resigned: bool
    def __init__(self, resigned: _Optional[bool] = ...) -> None: ...

class LeaderRequest(_message.Message):
    __slots__ = ("role", "group", "wait_ms", "known")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    role: str
    group: str
    wait_ms: int
    known: str
    def __init__(self, role: _Optional[str] = ..., group: _Optional[str] = ..., wait_ms: _Optional[int] = ..., known: _Optional[str] = ...) -> None: ...

class LeaderResponse(_message.Message):
    __slots__ = ("present", "leader", "in_sync", "token")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    present: bool
    leader: Leader
    in_sync: _containers.RepeatedScalarFieldContainer[str]
    token: str
    def __init__(self, present: _Optional[bool] = ..., leader: _Optional[_Union[Leader, _Mapping]] = ..., in_sync: _Optional[_Iterable[str]] = ..., token: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("healthy", "etcd_endpoint", "error")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    ETCD_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    etcd_endpoint: str
    error: str
    def __init__(self, healthy: _Optional[bool] = ..., etcd_endpoint: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...
