"""The capacity diagnosis table of docs/scheduling.md, and its sliding window."""

from __future__ import annotations

import pytest

from scheduler_svc.diagnosis import CapacityMonitor, CapacityReading, Diagnosis, diagnose


@pytest.mark.parametrize("running, waiting, preemptions, blocked_by, expected", [
    # the table's rows, each with the limit that actually stopped admission
    (8, 3, 0, "max_num_seqs", Diagnosis.CONCURRENCY_CAPPED),  # at the cap, waiting
    (5, 3, 0, "kv_cache", Diagnosis.MEMORY_CAPPED),  # below the cap, no free blocks
    (5, 3, 2, "preemption", Diagnosis.PAST_CAPACITY),  # below the cap, preemptions rising
    (5, 3, 2, "kv_cache", Diagnosis.PAST_CAPACITY),  # rising, whatever blocked last
    (8, 3, 2, "max_num_seqs", Diagnosis.PAST_CAPACITY),  # preemption decides at the cap
    (5, 0, 0, None, Diagnosis.HEALTHY),  # below the cap, nobody waits
    (0, 0, 0, None, Diagnosis.HEALTHY),  # idle
    # what the table's counts alone got wrong
    (5, 3, 0, "token_budget", Diagnosis.BUDGET_CAPPED),  # budget, not memory
    (5, 0, 4, None, Diagnosis.HEALTHY),  # preempted earlier, all resumed: nothing waits
    (8, 0, 0, None, Diagnosis.HEALTHY),  # at the cap with nobody waiting is fine
    (5, 3, 0, None, Diagnosis.HEALTHY),  # arrived since the last step: not blocked yet
])
def test_diagnosis_follows_the_table(running, waiting, preemptions, blocked_by, expected):
    assert diagnose(running, 8, waiting, preemptions, blocked_by) is expected


def test_budget_capped_names_the_budget_not_memory_as_the_lever():
    mon = CapacityMonitor(max_num_seqs=8)
    mon.observe(CapacityReading(2, 5, 0, 0, 0.1, "token_budget"), now_s=0.0)
    status = mon.status(0.0)
    assert status["diagnosis"] == "budget_capped"
    assert "--max-num-batched-tokens" in status["lever"]
    assert "memory" not in status["lever"]
    assert status["admission_blocked_by"] == "token_budget"


def reading(running=0, waiting=0, preemptions=0, kv=0.0, not_ready=0,
            blocked_by=None) -> CapacityReading:
    return CapacityReading(running, waiting, not_ready, preemptions, kv, blocked_by)


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
    mon.observe(reading(running=3, waiting=1, kv=1.0, preemptions=4, blocked_by="kv_cache"),
                now_s=5.0)
    assert mon.status(5.0)["diagnosis"] == "past_capacity"  # still inside the window
    mon.observe(reading(running=3, waiting=1, kv=1.0, preemptions=4, blocked_by="kv_cache"),
                now_s=12.5)
    assert mon.status(12.5)["diagnosis"] == "memory_capped"  # the window slid past them
    mon.observe(reading(running=1, kv=0.2, preemptions=4), now_s=13.0)
    assert mon.status(13.0)["diagnosis"] == "healthy"
    assert mon.status(13.0)["preemptions_total"] == 4


def test_a_drained_server_is_healthy_at_once_inside_the_preemption_window():
    mon = CapacityMonitor(max_num_seqs=4, window_s=30.0)
    mon.observe(reading(running=4), now_s=-1.0)
    mon.observe(reading(running=3, waiting=1, preemptions=1, blocked_by="preemption"), 0.0)
    assert mon.status(0.0)["diagnosis"] == "past_capacity"
    mon.observe(reading(running=0, preemptions=1), now_s=1.0)  # everything finished
    status = mon.status(1.0)
    assert status["diagnosis"] == "healthy" and status["preemptions_in_window"] == 1


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
    mon.observe(reading(running=2, waiting=5, kv=0.4, blocked_by="max_num_seqs"), now_s=0.0)
    status = mon.status(0.0)
    assert status["diagnosis"] == "concurrency_capped"
    assert "--max-num-seqs" in status["lever"]
    assert set(status) >= {"running", "max_num_seqs", "waiting", "preemption_rate_per_s",
                           "kv_cache_usage", "diagnosis", "summary", "lever"}


@pytest.mark.parametrize("kwargs", [{"max_num_seqs": 0}, {"max_num_seqs": 4, "window_s": 0}])
def test_monitor_refuses_bad_settings(kwargs):
    with pytest.raises(ValueError):
        CapacityMonitor(**kwargs)
