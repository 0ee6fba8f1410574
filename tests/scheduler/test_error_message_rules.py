"""Error events that reach a client carry a clean message, never a Python repr
(a failed gRPC call's str() is a multi-line '<_MultiThreadedRendezvous ...>')."""

import grpc

from scheduler_svc.engine_errors import describe


class FakeCallError(grpc.RpcError):
    def __str__(self):
        return "<_MultiThreadedRendezvous of RPC that terminated with:\n\tstatus = ...>"

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "Socket closed"


def test_a_grpc_error_is_described_by_its_code_and_details():
    assert describe(FakeCallError()) == "UNAVAILABLE: Socket closed"


def test_other_errors_give_their_first_line_or_their_type():
    assert describe(RuntimeError("worker lost\nmore")) == "worker lost"
    assert describe(RuntimeError("<object at 0x1>")) == "RuntimeError"
    assert describe(KeyError()) == "KeyError"
