"""The one error table: every domain error survives the trip through a gRPC status."""

from __future__ import annotations

import grpc
import pytest

from cluster import errors as E
from cluster import status


class _RpcError(grpc.RpcError):
    def __init__(self, code, details, trailing=None):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


# one instance of every domain error, with the arguments its constructor takes
EVERY_ERROR = [
    E.HourglassError("plain"), E.InvalidArgument("subject", "empty"), E.PayloadTooLarge("payload", "9 MiB"),
    E.UnknownSubject("orders.x"), E.NotFound("no such id"), E.TooLate("dispatched"), E.AlreadyExists("other content"),
    E.Unavailable("down"), E.NotLeader("127.0.0.1:7001"), E.NotLeader(None), E.StaleEpoch(3, 7),
    E.Overloaded("queue full"), E.DiskFull("no space left"),
    E.DiskFull("node 10.0.0.7:7001 has 999424 bytes (0.95 MiB) free on its data disk", "10.0.0.7:7001", 999424),
    E.ReplicationTimeout("no slave confirmed"),
    E.QuotaExceeded("'orders' owns 2000 subjects on this node (subjects_owned_max=2000); 1 of 1 new subjects refused",
                    "subjects_owned_max", "orders"),
    E.Closed("closing"), E.StorageError("broken"), E.CorruptRecord("/data/x.log", 4096, "crc mismatch"),
    E.OffsetOutOfRange(5, 0, 4, "past the end"), E.Unauthenticated("unauthenticated: unknown token"),
    E.PermissionDenied("permission denied: 'orders' may not consume subject 'pay.x'"),
    E.CannotListen("cannot listen on 127.0.0.1:1"),
    E.RouteMoved("real-time group rt-3 no longer takes subject 'orders'"),
]


def test_every_error_class_is_listed_here():
    listed = {type(e) for e in EVERY_ERROR}
    assert {c for c in status._error_classes().values() if c.__module__ == E.__name__} == listed


@pytest.mark.parametrize("err", EVERY_ERROR, ids=lambda e: type(e).__name__)
def test_the_table_works_both_ways(err):
    """A server's error (``status.abort``: status, text, class and arguments) comes back as
    the same error: class, text and attributes; the status alone could not tell DiskFull from
    Overloaded, StaleEpoch's epochs or a CorruptRecord's file."""
    back = status.from_rpc_error(_RpcError(status.to_grpc(err), str(err), status.to_metadata(err)))
    assert type(back) is type(err) and str(back) == str(err) and vars(back) == vars(err)


@pytest.mark.parametrize("code, cls", [(grpc.StatusCode.UNAUTHENTICATED, E.Unauthenticated),
                                       (grpc.StatusCode.PERMISSION_DENIED, E.PermissionDenied)])
def test_a_refusal_by_the_authenticator_comes_back_as_its_class(code, cls):
    """The interceptor refuses before any servicer runs, with a status and no error metadata."""
    back = status.from_rpc_error(_RpcError(code, "permission denied: 'x' may not produce", None))
    assert type(back) is cls and "permission denied" in str(back)


@pytest.mark.parametrize("err", EVERY_ERROR, ids=lambda e: type(e).__name__)
def test_every_error_pickles_as_it_was_made(err):
    import pickle

    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and vars(back) == vars(err)


def test_an_error_from_another_version_keeps_its_class_and_text():
    md = ((status.ERROR_KEY, "StaleEpoch"), (status.ERROR_ARGS_KEY, '["one too few"]'))
    back = status.from_rpc_error(_RpcError(grpc.StatusCode.FAILED_PRECONDITION, "stale epoch 1, current 2", md))
    assert type(back) is E.StaleEpoch and str(back) == "stale epoch 1, current 2"
    md = ((status.ERROR_KEY, "SomethingNew"),)  # a class this client does not know: from the status
    assert type(status.from_rpc_error(_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", md))) is E.Overloaded


@pytest.mark.parametrize("err", [
    E.InvalidArgument("subject", "empty"), E.NotFound("no such id"), E.Overloaded("queue full"),
    E.NotLeader("127.0.0.1:7001"),
    E.ReplicationTimeout("no slave confirmed within 5000 ms (ack_mode=sync); stored on the master"),
])
def test_round_trip_through_grpc_status(err):
    back = status.from_rpc_error(_RpcError(status.to_grpc(err), str(err)))
    assert type(back) is type(err)
    if isinstance(err, E.NotLeader):
        assert back.leader_hint == "127.0.0.1:7001"


def test_a_client_deadline_is_unavailable_not_a_replication_timeout():
    back = status.from_rpc_error(_RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert type(back) is E.Unavailable


def test_disk_full_without_metadata_is_still_disk_full_with_its_node_and_free_space():
    """A status without the error metadata (a proxy, another language's server) or a per-message
    code carries only the text; the client reads the node and its free bytes back from it, and
    the SDK does not retry it (``status.retryable``)."""
    text = "disk full: node 10.0.0.7:7001 has 999424 bytes (0.95 MiB) free on its data disk"
    for back in (status.from_rpc_error(_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, text)),
                 status.from_code(status.to_code(E.DiskFull(text)), text)):
        assert type(back) is E.DiskFull and str(back) == text
        assert (back.node, back.free_bytes) == ("10.0.0.7:7001", 999424)
        assert not status.retryable(back)
    assert status.retryable(E.Overloaded("queue full")) and status.retryable(E.NotLeader("a:1"))
    assert not status.retryable(E.InvalidArgument("subject", "empty"))


def test_route_moved_is_told_by_its_text_and_is_retried():
    """A real-time node's per-message "route moved" (a narrowing drains its group) comes back as
    ``RouteMoved`` from the code and text alone; the SDK retries it after asking for the route."""
    err = E.RouteMoved("real-time group rt-3 no longer takes subject 'orders'")
    assert str(err).startswith(status.ROUTE_MOVED_PREFIX)
    back = status.from_code(status.to_code(err), str(err))
    assert type(back) is E.RouteMoved and str(back) == str(err)
    assert status.retryable(back) and not status.final_refusal(str(err))
