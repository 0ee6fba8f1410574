"""The capacity diagnosis table of SCHEDULING.md, and its sliding window."""

from __future__ import annotations

import pytest

from scheduler_svc.diagnosis import CapacityMonitor, CapacityReading, Diagnosis, diagnose


@pytest.mark.parametrize("running, waiting, preemptions, expected", [
    (8, 3, 0, Diagnosis.CONCURRENCY_CAPPED),  # at max_num_seqs, waiting, no preemption
    (5, 3, 0, Diagnosis.MEMORY_CAPPED),       # below cap, waiting, no preemption
    (5, 3, 2, Diagnosis.PAST_CAPACITY),       # below cap, waiting, preemptions rising
    (8, 3, 2, Diagnosis.PAST_CAPACITY),       # preemption decides even at the cap
    (5, 0, 0, Diagnosis.HEALTHY),             # below cap, nobody waits
    (0, 0, 0, Diagnosis.HEALTHY),             # idle
])
def test_diagnosis_follows_the_table(running, waiting, preemptions, expected):
    assert diagnose(running, 8, waiting, preemptions) is expected


def reading(running=0, waiting=0, preemptions=0, kv=0.0, not_ready=0) -> CapacityReading:
    return CapacityReading(running, waiting, not_ready, preemptions, kv)


def test_diagnosis_flips_healthy_to_past_capacity_and_back_as_preemptions_stop():
    mon = CapacityMonitor(max_num_seqs=4, window_s=10.0)
    mon.observe(reading(running=2, kv=0.3), now_s=0.0)
    assert mon.status(0.0)["diagnosis"] == "healthy"
    mon.observe(reading(running=3, waiting=2, preemptions=1, kv=1.0), now_s=1.0)
    mon.observe(reading(running=3, waiting=2, preemptions=4, kv=1.0), now_s=2.0)
    status = mon.status(2.0)
    assert status["diagnosis"] == "past_capacity"
    assert status["preemptions_in_window"] == 4
    assert status["preemption_rate_per_s"] == pytest.approx(0.4)
    mon.observe(reading(running=1, kv=0.2, preemptions=4), now_s=5.0)
    assert mon.status(5.0)["diagnosis"] == "past_capacity"  # still inside the window
    assert mon.status(12.5)["diagnosis"] == "healthy"  # the window slid past them
    assert mon.status(12.5)["preemptions_total"] == 4


def test_requests_that_are_not_ready_are_not_a_capacity_problem():
    mon = CapacityMonitor(max_num_seqs=4)
    mon.observe(reading(running=1, waiting=0, not_ready=3), now_s=0.0)
    status = mon.status(0.0)
    assert status["diagnosis"] == "healthy"
    assert status["waiting_by_reason"] == {"capacity": 0, "not_ready": 3}


def test_preemptions_before_monitoring_began_do_not_count_as_rising():
    mon = CapacityMonitor(max_num_seqs=4, window_s=10.0)
    mon.observe(reading(running=1, preemptions=7), now_s=100.0)
    assert mon.status(100.0)["preemptions_in_window"] == 0


def test_status_names_the_lever_to_try_first():
    mon = CapacityMonitor(max_num_seqs=2)
    mon.observe(reading(running=2, waiting=5, kv=0.4), now_s=0.0)
    status = mon.status(0.0)
    assert status["diagnosis"] == "concurrency_capped"
    assert "--max-num-seqs" in status["lever"]
    assert set(status) >= {"running", "max_num_seqs", "waiting", "preemption_rate_per_s",
                           "kv_cache_usage", "diagnosis", "summary", "lever"}


@pytest.mark.parametrize("kwargs", [{"max_num_seqs": 0}, {"max_num_seqs": 4, "window_s": 0}])
def test_monitor_refuses_bad_settings(kwargs):
    with pytest.raises(ValueError):
        CapacityMonitor(**kwargs)
