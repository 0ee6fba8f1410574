"""message_from (shared/wire/readout.py): a read-out message filled by field name."""

from types import SimpleNamespace

import pytest

from shared.proto import generate_pb2
from shared.wire.mapper import WireMismatch
from shared.wire.readout import message_from

Timings = generate_pb2.RequestTimings  # arrival_unix_s, three *_ms, num_preemptions


def test_each_field_from_the_first_source_holding_its_name_a_keyword_first():
    first = {"time_to_first_token_ms": 1.5, "e2e_ms": 9.0, "mean_inter_token_ms": 0.5}
    second = SimpleNamespace(arrival_unix_s=100.0, num_preemptions=3, e2e_ms=-1.0,
                             unrelated="x")
    msg = message_from(Timings, first, second)
    assert (msg.arrival_unix_s, msg.time_to_first_token_ms, msg.e2e_ms,
            msg.mean_inter_token_ms, msg.num_preemptions) == (100.0, 1.5, 9.0, 0.5, 3)
    assert message_from(Timings, first, second, e2e_ms=4.0, num_preemptions=None) == \
        Timings(arrival_unix_s=100.0, time_to_first_token_ms=1.5, e2e_ms=4.0,
                mean_inter_token_ms=0.5)  # None: left unset


def test_a_field_no_source_holds_and_a_keyword_naming_no_field_are_refused():
    some = {"time_to_first_token_ms": 1.5, "e2e_ms": 9.0, "mean_inter_token_ms": 0.5}
    with pytest.raises(WireMismatch, match=r"RequestTimings\.arrival_unix_s: no value given "
                                           r"and no source holds 'arrival_unix_s' \(dict\)"):
        message_from(Timings, some, num_preemptions=1)
    with pytest.raises(WireMismatch, match=r"RequestTimings has no field \['e2e_s'\]"):
        message_from(Timings, some, arrival_unix_s=1.0, num_preemptions=1, e2e_s=2.0)
