from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[Code]
    INVALID_ARGUMENT: _ClassVar[Code]
    PAYLOAD_TOO_LARGE: _ClassVar[Code]
    UNKNOWN_SUBJECT: _ClassVar[Code]
    ALREADY_EXISTS: _ClassVar[Code]
    OVERLOADED: _ClassVar[Code]
    NOT_LEADER: _ClassVar[Code]
    NOT_FOUND: _ClassVar[Code]
    TOO_LATE: _ClassVar[Code]
    INTERNAL: _ClassVar[Code]
    REPLICATION_TIMEOUT: _ClassVar[Code]
OK: Code
INVALID_ARGUMENT: Code
PAYLOAD_TOO_LARGE: Code
UNKNOWN_SUBJECT: Code
ALREADY_EXISTS: Code
OVERLOADED: Code
NOT_LEADER: Code
NOT_FOUND: Code
TOO_LATE: Code
INTERNAL: Code
REPLICATION_TIMEOUT: Code

class SendBatchRequest(_message.Message):
    __slots__ = ("immediate", "epoch", "batch", "delay_ms")
    IMMEDIATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    immediate: bool
    epoch: int
    batch: bytes
    delay_ms: bytes
    def __init__(self, immediate: _Optional[bool] = ..., epoch: _Optional[int] = ..., batch: _Optional[bytes] = ..., delay_ms: _Optional[bytes] = ...) -> None: ...

class BatchError(_message.Message):
    __slots__ = ("index", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    error: str
    def __init__(self, index: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class SendBatchResponse(_message.Message):
    __slots__ = ("codes", "seqs", "deliver_at_ms", "duplicates", "errors", "refused")
    CODES_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    DELIVER_AT_MS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    codes: bytes
    seqs: bytes
    deliver_at_ms: bytes
    duplicates: bytes
    errors: _containers.RepeatedCompositeFieldContainer[BatchError]
    refused: StreamStatus
    def __init__(self, codes: _Optional[bytes] = ..., seqs: _Optional[bytes] = ..., deliver_at_ms: _Optional[bytes] = ..., duplicates: _Optional[bytes] = ..., errors: _Optional[_Iterable[_Union[BatchError, _Mapping]]] = ..., refused: _Optional[_Union[StreamStatus, _Mapping]] = ...) -> None: ...

class StreamStatus(_message.Message):
    __slots__ = ("code", "details", "error", "error_args")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_ARGS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    error: str
    error_args: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., error: _Optional[str] = ..., error_args: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("code", "seq", "error")
    CODE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    code: Code
    seq: int
    error: str
    def __init__(self, code: _Optional[_Union[Code, str]] = ..., seq: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("code", "status", "seq", "deliver_at_ms", "subject", "error", "accepted_ms", "effective_ms", "cancelled_ms", "store_epoch", "dispatched_ms", "dead_lettered", "realtime_group", "realtime_address", "group", "node_id", "accepted_node_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DELIVER_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_MS_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_MS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_MS_FIELD_NUMBER: _ClassVar[int]
    STORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_MS_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    REALTIME_GROUP_FIELD_NUMBER: _ClassVar[int]
    REALTIME_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    code: Code
    status: str
    seq: int
    deliver_at_ms: int
    subject: str
    error: str
    accepted_ms: int
    effective_ms: int
    cancelled_ms: int
    store_epoch: int
    dispatched_ms: int
    dead_lettered: bool
    realtime_group: str
    realtime_address: str
    group: str
    node_id: str
    accepted_node_id: str
    def __init__(self, code: _Optional[_Union[Code, str]] = ..., status: _Optional[str] = ..., seq: _Optional[int] = ..., deliver_at_ms: _Optional[int] = ..., subject: _Optional[str] = ..., error: _Optional[str] = ..., accepted_ms: _Optional[int] = ..., effective_ms: _Optional[int] = ..., cancelled_ms: _Optional[int] = ..., store_epoch: _Optional[int] = ..., dispatched_ms: _Optional[int] = ..., dead_lettered: _Optional[bool] = ..., realtime_group: _Optional[str] = ..., realtime_address: _Optional[str] = ..., group: _Optional[str] = ..., node_id: _Optional[str] = ..., accepted_node_id: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("subject", "group", "consumer_id", "max_messages", "wait_ms", "tags", "subjects", "acks", "lookahead_ms")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    SUBJECTS_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    subject: str
    group: str
    consumer_id: str
    max_messages: int
    wait_ms: int
    tags: _containers.RepeatedScalarFieldContainer[str]
    subjects: _containers.RepeatedScalarFieldContainer[str]
    acks: _containers.RepeatedCompositeFieldContainer[SubjectHandles]
    lookahead_ms: int
    def __init__(self, subject: _Optional[str] = ..., group: _Optional[str] = ..., consumer_id: _Optional[str] = ..., max_messages: _Optional[int] = ..., wait_ms: _Optional[int] = ..., tags: _Optional[_Iterable[str]] = ..., subjects: _Optional[_Iterable[str]] = ..., acks: _Optional[_Iterable[_Union[SubjectHandles, _Mapping]]] = ..., lookahead_ms: _Optional[int] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("batch", "handles", "refused")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    batch: bytes
    handles: bytes
    refused: StreamStatus
    def __init__(self, batch: _Optional[bytes] = ..., handles: _Optional[bytes] = ..., refused: _Optional[_Union[StreamStatus, _Mapping]] = ...) -> None: ...

class SubjectHandles(_message.Message):
    __slots__ = ("subject", "ranges")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    subject: str
    ranges: bytes
    def __init__(self, subject: _Optional[str] = ..., ranges: _Optional[bytes] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("group", "acks")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    group: str
    acks: _containers.RepeatedCompositeFieldContainer[SubjectHandles]
    def __init__(self, group: _Optional[str] = ..., acks: _Optional[_Iterable[_Union[SubjectHandles, _Mapping]]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: int
    def __init__(self, acked: _Optional[int] = ...) -> None: ...

class NackRequest(_message.Message):
    __slots__ = ("group", "retry_after_ms", "nacks")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    NACKS_FIELD_NUMBER: _ClassVar[int]
    group: str
    retry_after_ms: int
    nacks: _containers.RepeatedCompositeFieldContainer[SubjectHandles]
    def __init__(self, group: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., nacks: _Optional[_Iterable[_Union[SubjectHandles, _Mapping]]] = ...) -> None: ...

class NackResponse(_message.Message):
    __slots__ = ("retried", "dead_lettered")
    RETRIED_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    retried: int
    dead_lettered: int
    def __init__(self, retried: _Optional[int] = ..., dead_lettered: _Optional[int] = ...) -> None: ...

class BrowseRequest(_message.Message):
    __slots__ = ("subject", "group", "from_position", "max_messages")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    FROM_POSITION_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    subject: str
    group: str
    from_position: int
    max_messages: int
    def __init__(self, subject: _Optional[str] = ..., group: _Optional[str] = ..., from_position: _Optional[int] = ..., max_messages: _Optional[int] = ...) -> None: ...

class BrowseResponse(_message.Message):
    __slots__ = ("batch", "positions", "next_position", "end_position")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    END_POSITION_FIELD_NUMBER: _ClassVar[int]
    batch: bytes
    positions: bytes
    next_position: int
    end_position: int
    def __init__(self, batch: _Optional[bytes] = ..., positions: _Optional[bytes] = ..., next_position: _Optional[int] = ..., end_position: _Optional[int] = ...) -> None: ...

class TraceRequest(_message.Message):
    __slots__ = ("subject", "id", "around_ms")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    AROUND_MS_FIELD_NUMBER: _ClassVar[int]
    subject: str
    id: str
    around_ms: int
    def __init__(self, subject: _Optional[str] = ..., id: _Optional[str] = ..., around_ms: _Optional[int] = ...) -> None: ...

class GroupTrace(_message.Message):
    __slots__ = ("group", "state", "copy_id", "copy_subject", "copy_ms")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COPY_ID_FIELD_NUMBER: _ClassVar[int]
    COPY_SUBJECT_FIELD_NUMBER: _ClassVar[int]
    COPY_MS_FIELD_NUMBER: _ClassVar[int]
    group: str
    state: str
    copy_id: str
    copy_subject: str
    copy_ms: int
    def __init__(self, group: _Optional[str] = ..., state: _Optional[str] = ..., copy_id: _Optional[str] = ..., copy_subject: _Optional[str] = ..., copy_ms: _Optional[int] = ...) -> None: ...

class TraceResponse(_message.Message):
    __slots__ = ("position", "seq", "stored_ms", "node_id", "group", "attempts", "groups", "found_by")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_MS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    FOUND_BY_FIELD_NUMBER: _ClassVar[int]
    position: int
    seq: int
    stored_ms: int
    node_id: str
    group: str
    attempts: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupTrace]
    found_by: str
    def __init__(self, position: _Optional[int] = ..., seq: _Optional[int] = ..., stored_ms: _Optional[int] = ..., node_id: _Optional[str] = ..., group: _Optional[str] = ..., attempts: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupTrace, _Mapping]]] = ..., found_by: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("subject",)
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    subject: str
    def __init__(self, subject: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("node_id", "role", "group", "master", "epoch", "json")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    group: str
    master: bool
    epoch: int
    json: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., group: _Optional[str] = ..., master: _Optional[bool] = ..., epoch: _Optional[int] = ..., json: _Optional[str] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("summary", "corrupt", "unrepaired", "json")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    UNREPAIRED_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    summary: str
    corrupt: int
    unrepaired: int
    json: str
    def __init__(self, summary: _Optional[str] = ..., corrupt: _Optional[int] = ..., unrepaired: _Optional[int] = ..., json: _Optional[str] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("node_id", "epoch", "log", "offset", "max_bytes", "wait_ms", "history")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    log: str
    offset: int
    max_bytes: int
    wait_ms: int
    history: str
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., log: _Optional[str] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ..., wait_ms: _Optional[int] = ..., history: _Optional[str] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("epoch", "offset", "data", "end_offset", "truncate_to", "history", "checkpoint", "tick_state", "reset_to")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    TICK_STATE_FIELD_NUMBER: _ClassVar[int]
    RESET_TO_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    offset: int
    data: bytes
    end_offset: int
    truncate_to: int
    history: str
    checkpoint: str
    tick_state: bytes
    reset_to: int
    def __init__(self, epoch: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., end_offset: _Optional[int] = ..., truncate_to: _Optional[int] = ..., history: _Optional[str] = ..., checkpoint: _Optional[str] = ..., tick_state: _Optional[bytes] = ..., reset_to: _Optional[int] = ...) -> None: ...

class HandoverRequest(_message.Message):
    __slots__ = ("wait_ms",)
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    wait_ms: int
    def __init__(self, wait_ms: _Optional[int] = ...) -> None: ...

class ReadLogRequest(_message.Message):
    __slots__ = ("log", "offset", "max_bytes")
    LOG_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    log: str
    offset: int
    max_bytes: int
    def __init__(self, log: _Optional[str] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class ReadLogResponse(_message.Message):
    __slots__ = ("data", "error")
    DATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    error: str
    def __init__(self, data: _Optional[bytes] = ..., error: _Optional[str] = ...) -> None: ...

class HandoverResponse(_message.Message):
    __slots__ = ("done", "new_master", "error")
    DONE_FIELD_NUMBER: _ClassVar[int]
    NEW_MASTER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    done: bool
    new_master: str
    error: str
    def __init__(self, done: _Optional[bool] = ..., new_master: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...
