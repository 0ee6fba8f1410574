"""engine.proto <-> shared/types.py: the Session stream between a frontend and the
scheduler (frontend_svc/engine/engine_client.py, scheduler_svc/server.py)."""

from __future__ import annotations

from shared import types as t
from shared.proto import engine_pb2
from shared.wire import common  # noqa: F401 (pairs TokenLogprobs and FinishReason first)
from shared.wire.mapper import pair

# The wire names the client's id request_id (as the client API does); the core req_id.
REQUEST_OUTPUT = pair(t.RequestOutput, engine_pb2.RequestOutput,
                      renames={"request_id": "req_id"})

request_output_to_proto = REQUEST_OUTPUT.to_proto
request_output_from_proto = REQUEST_OUTPUT.from_proto

UNPAIRED = {
    "AddRequest": "built from the frontend's Choice (frontend_svc/engine/continuation.py), "
                  "read into the scheduler's core Request (scheduler_svc/server.py): both "
                  "hold more state than the wire, and no plain mirror sits between them",
    "AbortRequests": "a list of ids, read in place",
    "EngineRequest": "an envelope (oneof add / abort / batch)",
    "EngineRequests": "an envelope (a batch of EngineRequest)",
    "Rejection": "an engine Failure on the wire: built in scheduler_svc/server.py, read into "
                 "an EngineError in frontend_svc/engine/engine_client.py",
    "EngineResponse": "an envelope (outputs and rejections of one or more steps)",
    "GetStatusRequest": "an empty request",
    "EngineStatus": "a read-out of the scheduler's stats, diagnosis and engine counters, "
                    "filled by name from them (shared/wire/readout.py) in "
                    "scheduler_svc/server.py; no one core type mirrors it",
}
