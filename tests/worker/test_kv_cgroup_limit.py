"""The default CPU KV budget respects a container's memory limit (cgroup v2 and v1),
since /proc/meminfo inside a container shows the host's memory."""

from __future__ import annotations

from worker_svc import kv_capacity


def _files(tmp_path, limit: str, usage: str):
    (tmp_path / "max").write_text(limit + "\n")
    (tmp_path / "current").write_text(usage + "\n")
    return ((str(tmp_path / "max"), str(tmp_path / "current")),)


def test_a_cgroup_limit_leaves_limit_minus_usage(tmp_path):
    assert kv_capacity.cgroup_available(_files(tmp_path, str(3 << 30), str(1 << 30))) == 2 << 30


def test_no_limit_is_none_for_v2_max_and_v1_huge_numbers(tmp_path):
    assert kv_capacity.cgroup_available(_files(tmp_path, "max", "123")) is None
    assert kv_capacity.cgroup_available(_files(tmp_path, str(1 << 62), "123")) is None
    assert kv_capacity.cgroup_available(((str(tmp_path / "none"), "x"),)) is None


def test_usage_above_the_limit_leaves_nothing(tmp_path):
    assert kv_capacity.cgroup_available(_files(tmp_path, "100", "200")) == 0


def test_the_default_budget_takes_a_quarter_of_what_the_limit_leaves(tmp_path, monkeypatch):
    files = _files(tmp_path, str(1 << 30), str(200 << 20))
    monkeypatch.setattr(kv_capacity, "CGROUP_FILES", files)
    assert kv_capacity.default_cpu_kv_memory() == ((1 << 30) - (200 << 20)) // 4
