"""`gapserve serve` hands each service exactly the flags it understands."""

import pytest

from gapserve import cli
from gapserve.serve import children, serve_parser
from shared import config
from shared.flag_spec import flag_default
from worker_svc.server import worker_config

PARSERS = {"worker": config.worker_parser, "scheduler": config.scheduler_parser,
           "frontend": config.frontend_parser}


def serve_children(argv, environ=None):
    args = config.parse_args(serve_parser(), argv, environ=environ or {})
    return {c.name: c for c in children(args)}


def parsed(child):
    command, *rest = child.argv
    return config.parse_args(PARSERS[command](), rest, environ={})


def test_every_child_command_parses_with_its_own_service_parser():
    kids = serve_children(["--model", "/m", "--no-enable-prefix-caching", "--max-num-seqs", "8",
                           "--kv-cache-memory", "1000", "--served-model-name", "x",
                           "--quantization", "int8"])
    assert set(kids) == {"worker-0", "scheduler", "frontend"}
    worker, scheduler, frontend = (parsed(kids[n]) for n in ("worker-0", "scheduler", "frontend"))
    assert (worker.model, worker.kv_cache_memory, worker.max_num_seqs) == ("/m", 1000, 8)
    assert worker_config(worker).quantization == "int8"
    assert (scheduler.enable_prefix_caching, scheduler.max_num_seqs) == (False, 8)
    assert (frontend.model, frontend.served_model_name) == ("/m", "x")


def test_serve_wires_the_ports_between_the_services():
    kids = serve_children(["--scheduler-port", "7002", "--worker-port", "7003",
                           "--http-port", "7080", "--grpc-port", "7051"])
    assert parsed(kids["worker-0"]).port == 7003
    scheduler = parsed(kids["scheduler"])
    assert (scheduler.port, scheduler.worker_addresses) == (7002, ["127.0.0.1:7003"])
    frontend = parsed(kids["frontend"])
    assert (frontend.scheduler_address, frontend.http_port, frontend.grpc_port) == (
        "127.0.0.1:7002", 7080, 7051)


def test_serve_reads_its_flags_from_the_environment_too():
    kids = serve_children([], environ={"GAPSERVE_SCHEDULING_POLICY": "priority",
                                       "GAPSERVE_BLOCK_SIZE": "32"})
    assert parsed(kids["scheduler"]).scheduling_policy == "priority"
    assert parsed(kids["worker-0"]).block_size == 32


def test_one_worker_per_tensor_parallel_rank_on_consecutive_ports():
    kids = serve_children(["--tensor-parallel-size", "2", "--worker-port", "7003"])
    assert parsed(kids["worker-1"]).port == 7004 and parsed(kids["worker-1"]).rank == 1
    assert parsed(kids["scheduler"]).worker_addresses == ["127.0.0.1:7003", "127.0.0.1:7004"]


def test_unknown_command_is_a_usage_error(capsys):
    assert cli.main(["bogus"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_the_combined_parser_has_a_subcommand_per_command_with_its_real_flags():
    import argparse
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(cli.COMMANDS)
    assert parser.parse_args(["worker", "--rank", "2"]).rank == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--rank", "x"])


def test_serve_binds_only_the_frontend_to_host_and_the_inner_services_to_loopback():
    kids = serve_children(["--host", "0.0.0.0"])
    assert parsed(kids["frontend"]).host == "0.0.0.0"
    assert parsed(kids["scheduler"]).host == "127.0.0.1"
    assert parsed(kids["worker-0"]).host == "127.0.0.1"
    assert kids["scheduler"].health_address.startswith("127.0.0.1:")


def test_serve_hands_secrets_to_the_children_in_their_environment_not_their_argv(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not read by a child here")
    kids = serve_children(["--api-key", "sek-1,sek-2", "--priority-keys", "sek-prio",
                           "--internal-token", "sek-tok", "--tls-ca", str(ca),
                           "--max-queued-requests", "7"])
    for child in kids.values():
        assert not any(secret in arg for arg in child.argv for secret in ("sek-",))
        assert child.env["GAPSERVE_INTERNAL_TOKEN"] == "sek-tok"
        args = config.parse_args(PARSERS[child.argv[0]](), child.argv[1:], environ=child.env)
        assert (args.internal_token, args.tls_ca) == ("sek-tok", str(ca))
    frontend = config.parse_args(config.frontend_parser(), kids["frontend"].argv[1:],
                                 environ=kids["frontend"].env)
    assert (frontend.api_key, frontend.priority_keys) == (["sek-1", "sek-2"], ["sek-prio"])
    assert frontend.max_queued_requests == 7
    assert "GAPSERVE_API_KEY" not in kids["scheduler"].env  # only the frontend checks keys


def test_serve_gives_rank_0_the_compile_timeout_the_frontend_checks_with():
    """A grammar the frontend let through within its bound must not time out on rank 0
    under another: one flag, which serve forwards to both."""
    kids = serve_children(["--structured-outputs-compile-timeout-s", "3"])
    assert parsed(kids["frontend"]).structured_outputs_compile_timeout_s == 3.0
    worker = parsed(kids["worker-0"])
    assert worker.structured_outputs_compile_timeout_s == 3.0
    assert worker_config(worker).structured_outputs_compile_timeout_s == 3.0
    default = serve_children([])
    assert parsed(default["worker-0"]).structured_outputs_compile_timeout_s == \
        parsed(default["frontend"]).structured_outputs_compile_timeout_s == \
        config.DEFAULT_COMPILE_TIMEOUT_S


def test_a_renamed_variable_is_refused_with_its_new_name_not_ignored(capsys):
    with pytest.raises(SystemExit):
        config.parse_args(config.worker_parser(), [],
                          environ={"GAPSERVE_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S": "3"})
    assert "GAPSERVE_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S" in capsys.readouterr().err


def test_serve_forwards_every_flag_a_child_takes_and_serve_was_given():
    """Built from the declarations: a child gets each of its flags that serve also
    takes (secrets in its environment), except what serve sets per child."""
    from dataclasses import fields
    kids = serve_children([])
    for name, child in (("worker-0", config.WorkerFlags), ("scheduler", config.SchedulerFlags),
                        ("frontend", config.FrontendFlags)):
        serve_has = {f.name for f in fields(config.ServeFlags)}
        expected = {f.name for f in fields(child) if f.name in serve_has
                    and not f.metadata["secret"] and not f.metadata["per_child"]
                    and flag_default(f) is not None}
        given = {a[2:].replace("-", "_").removeprefix("no_") for a in kids[name].argv
                 if a.startswith("--")}
        assert expected <= given, (name, expected - given)


def test_a_worker_flag_named_like_a_worker_config_field_sets_that_field():
    """No hand-written mapping: the flag's dest and the field's name are one setting."""
    args = config.parse_args(config.worker_parser(), [
        "--block-size", "32", "--seed", "7", "--cpu-threads", "3", "--no-cpu-prepack",
        "--distributed-timeout", "5", "--max-num-seqs", "9", "--rank", "0"], environ={})
    cfg = worker_config(args)
    assert (cfg.block_size, cfg.seed, cfg.cpu_threads, cfg.cpu_prepack,
            cfg.distributed_timeout, cfg.max_num_seqs) == (32, 7, 3, False, 5.0, 9)
    unset = worker_config(config.parse_args(config.worker_parser(), [], environ={}))
    assert (unset.max_num_seqs, unset.max_num_batched_tokens, unset.model) == (256, None, None)


def test_serve_can_start_the_scheduler_and_frontend_nicer_than_the_workers():
    """--helper-nice rides to the scheduler and frontend in their environment; the
    workers get none, so their compute threads win a shared core. The default, 0,
    sets nothing: equal shares, as before."""
    kids = serve_children(["--helper-nice", "19"])
    assert kids["scheduler"].env[config.NICE_ENV] == "19"
    assert kids["frontend"].env[config.NICE_ENV] == "19"
    assert config.NICE_ENV not in kids["worker-0"].env
    default = serve_children([])
    assert config.NICE_ENV not in default["scheduler"].env
    assert config.NICE_ENV not in default["frontend"].env
    assert serve_children([], environ={"GAPSERVE_HELPER_NICE": "19"})["frontend"].env[
        config.NICE_ENV] == "19"
    with pytest.raises(SystemExit):
        serve_children(["--helper-nice", "20"])


@pytest.mark.parametrize("command,value,expected", [("scheduler", "7", 7), ("frontend", "3", 3),
                                                    ("status", "7", 0)])
def test_a_service_lowers_its_own_priority_before_it_starts(command, value, expected):
    """In a fresh process (niceness only ever goes up): a service command applies
    GAPSERVE_PROCESS_NICE before importing the service; other commands ignore it."""
    import os
    import subprocess
    import sys
    code = ("import os; from gapserve import cli; base = os.nice(0); "
            f"cli._start_nice({command!r}); print(os.nice(0) - base)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, config.NICE_ENV: value}, check=True)
    assert int(out.stdout) == expected


def test_a_bad_process_niceness_stops_the_service_with_its_name():
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "from gapserve import cli; cli._start_nice('worker')"],
                         capture_output=True, text=True,
                         env={**os.environ, config.NICE_ENV: "high"})
    assert out.returncode != 0 and "GAPSERVE_PROCESS_NICE='high'" in out.stderr
