"""stack_ceiling: the real stack (gapserve serve, every service) with a dummy-weight,
zero-cost-step worker streams every token it promises; and its arguments and table."""

from __future__ import annotations

import pytest

from tests.integration.tiny_model import tiny_llama_dir
from tests.ports import free_ports

from .test_serve_bench import _load

ceiling = _load("stack_ceiling")


def _free_port_block(span: int = 60) -> int:
    """A port whose +51..+53 neighbours are free too (the stack's inner services)."""
    return free_ports(1, span=span)[0]


@pytest.mark.parametrize("frontends,steps", [(1, 1), (2, 4)])
def test_the_stack_streams_every_token_from_a_zero_cost_worker(tmp_path, frontends, steps):
    args = ceiling.parse_args(["--concurrency", "4,12", "--max-tokens", "9",
                               "--api-server-count", str(frontends),
                               "--num-scheduler-steps", str(steps),
                               "--model", str(tiny_llama_dir()),
                               "--port", str(_free_port_block()), "--log-dir", str(tmp_path)])
    result = ceiling.run(args)
    points = {p["concurrency"]: p for p in result["points"]}
    assert set(points) == {4, 12}
    for p in points.values():
        assert p["errors"] == 0 and p["output_tok_s"] > 0
        assert p["frontends"] == frontends  # --api-server-count: that many processes serve
        assert {"frontend", "scheduler", "worker", "client"} <= set(p["cores"])
    assert f"| 12 | {frontends} | {steps} |" in ceiling.markdown(result)


def test_the_worker_is_started_with_dummy_weights_and_zero_cost_steps_for_every_stream():
    argv = ceiling.serve_argv(ceiling.parse_args(["--concurrency", "256,1000"]))
    assert "--zero-cost-steps" in argv and argv[argv.index("--load-format") + 1] == "dummy"
    assert argv[argv.index("--max-num-seqs") + 1] == "1000"


@pytest.mark.parametrize("argv", [["--concurrency", "0"], ["--concurrency", "a,b"],
                                  ["--max-tokens", "0"], ["--rounds", "0"],
                                  ["--api-server-count", "0"],
                                  ["--num-scheduler-steps", "0"]])
def test_bad_arguments_exit_with_a_usage_error(argv):
    with pytest.raises(SystemExit) as exc:
        ceiling.parse_args(argv)
    assert exc.value.code == 2


def test_process_roles_come_from_the_command_line():
    assert ceiling.role("python -m gapserve frontend --http-port 1") == "frontend"
    assert ceiling.role("python -m gapserve worker --rank 0") == "worker"
