"""The one error table: every domain error survives the trip through a gRPC status."""

from __future__ import annotations

import grpc
import pytest

from cluster import errors as E
from cluster import status


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


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
