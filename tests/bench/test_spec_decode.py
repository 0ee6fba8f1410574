"""spec_decode.py: the rows it starts (gapserve's with --speculative-config, llama-server's
with its own speculation flags), its table and ratios, llama-server's acceptance lines,
and side_by_side.py's speculative rows. The measuring itself is serve_bench's."""

from __future__ import annotations

import json

import pytest

from shared.speculative_config import parse_speculative_config

from .test_serve_bench import _load

sd = _load("spec_decode")
sbs = _load("side_by_side")


def test_each_row_is_its_servers_plain_command_with_its_speculation_flags():
    specs = sd.server_commands(sd.parse_args(["--ngram-k", "4", "--draft-k", "3",
                                              "--disable-by-batch-size", "12"]))
    plain = specs["gapserve"]["argv"]
    for name, method, k in (("gapserve-ngram", "ngram", 4),
                            ("gapserve-int8draft", "draft_model", 3)):
        argv = specs[name]["argv"]
        i = argv.index("--speculative-config")
        cfg = parse_speculative_config(argv[i + 1])  # the worker's own parser takes it
        assert (cfg.method, cfg.num_speculative_tokens, cfg.disable_by_batch_size) == \
            (method, k, 12)
        assert argv[:i] + argv[i + 2:] == plain
    assert parse_speculative_config(
        specs["gapserve-int8draft"]["argv"][-1]).is_int8_self_draft
    llama = specs["llamacpp"]["argv"]
    assert specs["llamacpp-ngram"]["argv"][len(llama):] == [
        "--spec-type", "ngram-simple", "--spec-draft-n-max", "64"]
    draft = specs["llamacpp-draft"]["argv"]
    assert draft[draft.index("-md") + 1].endswith("q8_0.gguf")
    assert draft[draft.index("--spec-type") + 1] == "draft-simple"


def test_llama_arg_reaches_each_llama_server_row_only():
    specs = sd.server_commands(sd.parse_args(["--llama-arg=-nr"]))
    for name, spec in specs.items():
        assert ("-nr" in spec["argv"]) == name.startswith("llamacpp"), name


def test_llama_servers_acceptance_is_summed_from_its_log_lines():
    log = ("I slot print_timing: id  0 | task 2 | draft acceptance = 0.61458 (   59 accepted "
           "/    96 generated), mean len = 30.50\nother\n"
           "I slot print_timing: id  1 | task 9 | draft acceptance = 0.5 (    1 accepted /"
           "     2 generated), mean len = 1.00\n")
    assert sd.llama_acceptance(log) == (60, 98)
    assert sd.llama_acceptance("nothing here") == (0, 0)


def _repeat(tok_s: dict, drafts: tuple | None = None) -> dict:
    return {"runs": {k: {"output_throughput": v, **({"drafts": drafts} if drafts else {})}
                     for k, v in tok_s.items()}}


def test_the_table_gives_medians_acceptance_and_ratios_to_the_plain_and_llama_rows():
    results = {"workloads": ["copy"], "levels": [1], "rows": {
        "gapserve": {"repeats": [_repeat({"copy@1": v}) for v in (40.0, 50.0, 45.0)]},
        "gapserve-ngram": {"repeats": [_repeat({"copy@1": v}, (30, 40))
                                       for v in (110.0, 90.0, 100.0)]},
        "llamacpp": {"repeats": [_repeat({"copy@1": 40.0})]},
        "llamacpp-ngram": {"repeats": [_repeat({"copy@1": 50.0}, (10, 20))]},
    }, "exact": {"gapserve-ngram": True}}
    table = sd.markdown(results)
    assert "| gapserve-ngram | 100.0 (90.0-110.0), acc 0.75 |" in table
    assert "- gapserve-ngram / gapserve: copy x1 2.22x" in table
    assert "- llamacpp-ngram / llamacpp: copy x1 1.25x" in table
    assert "- gapserve-ngram / llamacpp-ngram (llama-server's best speculating row at " \
           "copy x1): 2.00x" in table
    assert "gapserve-ngram yes" in table


def test_the_workloads_requests_cycle_the_prompts(tmp_path):
    path = sd.requests_file("code", 20, tmp_path)
    items = json.loads(path.read_text())
    assert len(items) == 20 and items[0] == items[8]
    assert sd.num_requests("copy", 1) == 8 and sd.num_requests("copy", 64) == 128
    assert all(i["max_tokens"] == sd.ANSWER_TOKENS for i in items)
    essay = json.loads(sd.requests_file("essay", 3, tmp_path).read_text())
    assert essay[2]["messages"][0]["content"].endswith("number 2.")


@pytest.mark.parametrize("argv", [["--rows", "gapserve,tgi"], ["--workloads", "poems"],
                                  ["--concurrency", "0"], ["--repeats", "0"]])
def test_bad_arguments_exit_with_a_usage_error(argv):
    with pytest.raises(SystemExit) as exc:
        sd.parse_args(argv)
    assert exc.value.code == 2


def test_side_by_side_has_the_speculating_rows_beside_their_plain_ones():
    specs = sbs.server_commands(sbs.parse_args([]))
    for name in ("gapserve-ngram", "gapserve-int8draft"):
        argv = specs[name]["argv"]
        i = argv.index("--speculative-config")
        assert parse_speculative_config(argv[i + 1]).disable_by_batch_size == 16
        assert argv[:i] + argv[i + 2:] == specs["gapserve"]["argv"]
    assert "--spec-type" in specs["llamacpp-ngram"]["argv"]
    assert "-md" in specs["llamacpp-draft"]["argv"]
    assert sbs.PAIRS["gapserve-int8draft"] == ("gapserve", "llamacpp-draft")
