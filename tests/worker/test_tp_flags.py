"""Tensor-parallel rendezvous flags: the flag wins over GAPSERVE_MASTER_*, which wins
over torchrun's MASTER_ADDR / MASTER_PORT, which win over 127.0.0.1:29500."""

import pytest

from shared import config as flags
from worker_svc.config import WorkerConfig
from worker_svc.server import worker_config


def _cfg(argv, environ, monkeypatch):
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    args = flags.parse_args(flags.worker_parser(), argv, environ=environ)
    return worker_config(args)


def test_rendezvous_defaults_to_loopback_29500(monkeypatch):
    cfg = _cfg([], {}, monkeypatch)
    assert (cfg.master_addr, cfg.master_port) == ("127.0.0.1", 29500)


def test_torchrun_variables_are_accepted(monkeypatch):
    cfg = _cfg([], {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29600"}, monkeypatch)
    assert (cfg.master_addr, cfg.master_port) == ("10.0.0.5", 29600)


def test_gapserve_variables_and_flags_win_over_torchrun_ones(monkeypatch):
    env = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29600",
           "GAPSERVE_MASTER_ADDR": "worker", "GAPSERVE_MASTER_PORT": "29700"}
    cfg = _cfg([], env, monkeypatch)
    assert (cfg.master_addr, cfg.master_port) == ("worker", 29700)
    cfg = _cfg(["--master-addr", "rank0", "--master-port", "29800"], env, monkeypatch)
    assert (cfg.master_addr, cfg.master_port) == ("rank0", 29800)


@pytest.mark.parametrize("bad, match", [
    (dict(tensor_parallel_rank=2, tensor_parallel_size=2), "rank 2"),
    (dict(distributed_timeout=0), "distributed_timeout"),
    (dict(distributed_backend="mpi"), "distributed_backend")])
def test_bad_tensor_parallel_settings_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        WorkerConfig(**bad).validate()
