"""The wire mapping's function names, in one import for the services and tests that
call them (scheduler_svc/worker_group.py, worker_svc/server.py): the mapping itself is
shared/wire/, one module per boundary, derived from the proto descriptors."""

from __future__ import annotations

from shared.wire.common import (  # noqa: F401 (re-exported)
    logprobs_from_proto, logprobs_to_proto, model_info_from_proto, model_info_to_proto,
    sampling_from_proto, sampling_to_proto)
from shared.wire.engine import request_output_from_proto, request_output_to_proto  # noqa: F401
from shared.wire.worker import (  # noqa: F401
    runner_output_from_proto, runner_output_to_proto, scheduler_output_from_proto,
    scheduler_output_to_proto, timings_from_proto, timings_to_proto)
