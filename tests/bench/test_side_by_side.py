"""side_by_side: the servers' commands, the comparison table and its ratios, and how
it refuses bad input and a missing server binary. Starting and measuring a server is
server_runs' (test_server_runs.py); the load itself is serve_bench's (tested there)."""

from __future__ import annotations

import pytest

from .test_serve_bench import _load

sbs = _load("side_by_side")


def _report(tok_s: float, ttft_ms: float, rss: int, kv: int | None = None,
            concurrency: int = 64) -> dict:
    memory = {"sum_peak_rss_bytes": rss}
    if kv is not None:
        memory["kv_cache_bytes"] = kv
    return {"output_throughput": tok_s, "concurrency": concurrency,
            "ttft_ms": {"mean": ttft_ms, "p50": ttft_ms, "p99": ttft_ms},
            "itl_ms": {"mean": 300.0, "p50": 300.0, "p99": 300.0}, "memory": memory,
            "machine": {"other_cores": 0.05}}


def _run(conc_tok_s: float, single_tok_s: float, rss: int = 2_000_000_000,
         kv: int | None = 1_000_000_000) -> dict:
    # memory is read after each part; the single part's reading holds the run's peaks
    return {"concurrent": _report(conc_tok_s, 2000.0, rss, kv),
            "single": _report(single_tok_s, 100.0, rss, kv, 1), "load_avg_1m_before": 0.5}


def _results() -> dict:
    return {"servers": {
        "gapserve": {"runs": [_run(250.0, 25.0), _run(270.0, 30.0), _run(240.0, 20.0)],
                     "agreement": {"prompts": 8, "identical": 8, "prefix_share": 1.0}},
        "vllm": {"runs": [_run(200.0, 12.5, 5_000_000_000), _run(150.0, 15.0, 5_000_000_000),
                          _run(210.0, 10.0, 5_000_000_000)]},
        "gapserve-bf16": {"runs": [_run(400.0, 50.0)],
                          "agreement": {"prompts": 8, "identical": 5, "prefix_share": 0.8}},
        "llamacpp-q8_0": {"runs": [_run(200.0, 40.0, kv=None)]},
    }}


def test_ratios_are_of_the_medians_over_the_repeats():
    table = sbs.markdown(_results())
    # medians 250/200 and 25/12.5
    assert "gapserve / vllm, medians: 1.25x at 64 concurrent, 2.00x single stream" in table


def test_best_dtype_rows_are_compared_with_each_other_not_with_fp32():
    table = sbs.markdown(_results())
    assert "gapserve-bf16 / llamacpp-q8_0, medians: 2.00x at 64 concurrent, 1.25x single" in table
    assert "gapserve-bf16 / vllm," not in table and "gapserve / llamacpp-q8_0" not in table


def test_each_row_has_the_median_and_range_of_its_repeats_and_its_agreement():
    rows = {line.split("|")[1].strip(): line for line in sbs.markdown(_results()).splitlines()
            if line.startswith("| ")}
    assert "| 250.0 (240.0-270.0) | 2.00 (2.00-2.00) |" in rows["gapserve"]
    assert "| 25.0 (20.0-30.0) |" in rows["gapserve"]
    assert "8/8 identical, 100% of tokens" in rows["gapserve"]
    assert "5/8 identical, 80% of tokens" in rows["gapserve-bf16"]
    assert "| 400.0 | 2.00 |" in rows["gapserve-bf16"]  # one run: no range


def test_summary_takes_medians_and_ranges():
    m = sbs.summarize(_results()["servers"]["vllm"]["runs"])
    assert m["concurrent_tok_s"] == {"median": 200.0, "min": 150.0, "max": 210.0, "n": 3}
    assert m["peak_rss_gb"]["median"] == 5.0


def test_a_table_without_servers_says_so():
    assert sbs.markdown({"servers": {}}) == "(no server was measured)"


@pytest.mark.parametrize("argv", [["--servers", "gapserve,tgi"], ["--servers", "llama.cpp"],
                                  ["--servers", "vllm,vllm"], ["--concurrency", "0"],
                                  ["--single-requests", "0"], ["--kv-cache-gib", "0"],
                                  ["--repeats", "0"], ["--agreement-prompts", "-1"],
                                  ["--endpoint", "responses"]])
def test_bad_arguments_exit_with_a_usage_error(argv):
    with pytest.raises(SystemExit) as exc:
        sbs.parse_args(argv)
    assert exc.value.code == 2


def test_both_servers_get_the_same_kv_cache_size():
    specs = sbs.server_commands(sbs.parse_args(["--kv-cache-gib", "0.5"]))
    gapserve_argv = specs["gapserve"]["argv"]
    assert gapserve_argv[gapserve_argv.index("--kv-cache-memory") + 1] == str(2**29)
    assert specs["vllm"]["env"]["VLLM_CPU_KVCACHE_SPACE"] == "0.5"
    assert specs["vllm"]["kv_bytes"] == 2**29


def test_every_server_gets_every_core():
    specs = sbs.server_commands(sbs.parse_args([]))
    cores = sbs.os.cpu_count()
    # vLLM's compute threads bound to all cores, as its CPU docs advise for a dedicated box
    assert specs["vllm"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{cores - 1}"
    assert specs["vllm-bf16"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{cores - 1}"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in specs["vllm-default"]["env"]  # its own binding
    for name in ("llamacpp", "llamacpp-q8_0"):
        argv = specs[name]["argv"]
        assert argv[argv.index("-t") + 1] == argv[argv.index("-tb") + 1] == str(cores)


def test_best_dtype_rows_start_each_server_in_its_best_dtype():
    args = sbs.parse_args(["--llama-gguf-q8", "/m/q8.gguf"])
    specs = sbs.server_commands(args)
    for name in ("gapserve-bf16", "vllm-bf16"):
        argv = specs[name]["argv"]
        assert argv[argv.index("--dtype") + 1] == "bfloat16"
    for name in ("gapserve", "vllm", "vllm-default"):
        argv = specs[name]["argv"]
        assert argv[argv.index("--dtype") + 1] == "float32"
    assert specs["llamacpp-q8_0"]["argv"][specs["llamacpp-q8_0"]["argv"].index("-m") + 1] \
        == "/m/q8.gguf"
    int8 = specs["gapserve-int8"]["argv"]  # int8 decode weights, fp32 wide steps
    assert int8[int8.index("--quantization") + 1] == "int8"
    assert int8[int8.index("--dtype") + 1] == "float32"
    assert "--quantization" not in specs["gapserve"]["argv"]


def test_multi_step_rows_are_the_plain_rows_with_eight_passes_a_step():
    specs = sbs.server_commands(sbs.parse_args([]))
    for name, plain in (("gapserve-steps8", "gapserve"), ("gapserve-int8-steps8", "gapserve-int8")):
        argv = specs[name]["argv"]
        assert argv[argv.index("--num-scheduler-steps") + 1] == "8"
        i = argv.index("--num-scheduler-steps")
        assert argv[:i] + argv[i + 2:] == specs[plain]["argv"]
    assert "--num-scheduler-steps" not in specs["gapserve"]["argv"]


def test_the_per_token_column_is_tpot_so_multi_token_chunks_do_not_inflate_it():
    results = _results()
    for run in results["servers"]["gapserve"]["runs"]:
        run["single"]["tpot_ms"] = {"mean": 37.5, "p50": 37.5, "p99": 37.5}  # ITL says 300
    row = next(line for line in sbs.markdown(results).splitlines()
               if line.startswith("| gapserve |"))
    assert "| 37.5 (37.5-37.5) |" in row and "mean TPOT ms" in sbs.markdown(results)


def test_llama_server_gets_the_gguf_one_slot_per_request_and_every_core():
    args = sbs.parse_args(["--servers", "llamacpp", "--llama-gguf", "/m/smol-f32.gguf",
                           "--llama-server", "/bin/llama-server", "--concurrency", "64"])
    argv = sbs.server_commands(args)["llamacpp"]["argv"]
    flag = {name: argv[argv.index(name) + 1] for name in ("-m", "-np", "-c", "-t", "-tb")}
    assert argv[0] == "/bin/llama-server" and flag["-m"] == "/m/smol-f32.gguf"
    # 64 slots of 256 tokens: a ~41-token essay prompt plus 128 output tokens fits each
    assert flag["-np"] == "64" and flag["-c"] == str(64 * 256)
    assert flag["-t"] == flag["-tb"] == str(sbs.os.cpu_count())
    assert "-cb" in argv


def test_llama_server_slots_grow_with_the_output_length():
    args = sbs.parse_args(["--servers", "llamacpp", "--concurrency", "8",
                           "--max-tokens", "300"])
    argv = sbs.server_commands(args)["llamacpp"]["argv"]
    assert argv[argv.index("-c") + 1] == str(8 * 512)


def test_llama_server_kv_cache_is_f16_k_and_v_for_every_layer_and_token(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,'
        ' "num_key_value_heads": 3}')
    assert sbs.llama_kv_bytes(str(tmp_path), 16384) == 16384 * 30 * 2 * 3 * 64 * 2
    assert sbs.llama_kv_bytes(str(tmp_path / "missing"), 16384) is None


def test_a_missing_server_binary_fails_with_a_message_not_a_traceback(tmp_path, capsys):
    code = sbs.main(["--servers", "llamacpp", "--llama-server", str(tmp_path / "none"),
                     "--log-dir", str(tmp_path), "--agreement-prompts", "0"])
    assert code == 2
    assert "side_by_side: llamacpp:" in capsys.readouterr().err


def test_a_gguf_model_is_served_by_gapserve_and_llama_server_from_the_same_file():
    args = sbs.parse_args(["--model", "/m/smol.Q4_1.gguf", "--llama-server", "/bin/llama-server"])
    specs = sbs.server_commands(args)
    assert specs["llamacpp"]["argv"][specs["llamacpp"]["argv"].index("-m") + 1] \
        == "/m/smol.Q4_1.gguf"
    exact, quantized = specs["gapserve"]["argv"], specs["gapserve-quantized"]["argv"]
    for argv in (exact, quantized):
        assert argv[argv.index("--model") + 1] == "/m/smol.Q4_1.gguf"
    # float32: the exact dequantized path; no --dtype: the file's own (quantized) path
    assert exact[exact.index("--dtype") + 1] == "float32" and "--dtype" not in quantized
    i = exact.index("--dtype")
    assert exact[:i] + exact[i + 2:] == quantized
    # a named --llama-gguf still wins; a checkpoint directory keeps the fp32 default
    other = sbs.parse_args(["--model", "/m/smol.Q4_1.gguf", "--llama-gguf", "/m/q8.gguf"])
    assert other.llama_gguf == "/m/q8.gguf"
    assert sbs.parse_args([]).llama_gguf == sbs.LLAMA_F32_GGUF


def test_the_quantized_row_is_compared_with_llama_server_and_the_exact_path():
    results = _results()
    results["servers"]["gapserve-quantized"] = {"runs": [_run(300.0, 50.0)]}
    results["servers"]["llamacpp"] = {"runs": [_run(200.0, 40.0, kv=None)]}
    table = sbs.markdown(results)
    assert "gapserve-quantized / llamacpp, medians: 1.50x at 64 concurrent, 1.25x single" \
        in table
    assert "gapserve-quantized / gapserve, medians: 1.20x at 64 concurrent, 2.00x single" \
        in table


def test_auto_endpoint_is_completions_for_a_model_without_a_chat_template(tmp_path):
    base, chat, inline = tmp_path / "base", tmp_path / "chat", tmp_path / "inline"
    for d in (base, chat, inline):
        d.mkdir()
    (base / "tokenizer_config.json").write_text('{"bos_token": "<bos>"}')
    (chat / "chat_template.jinja").write_text("{{ messages }}")
    (inline / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    chosen = {}
    for d in (base, chat, inline):
        args = sbs.parse_args(["--model", str(d)])
        sbs.resolve_model_dir(args)
        chosen[d.name] = args.endpoint
    assert chosen == {"base": "completions", "chat": "chat", "inline": "chat"}
    args = sbs.parse_args(["--model", str(base), "--endpoint", "chat"])  # a flag wins
    sbs.resolve_model_dir(args)
    assert args.endpoint == "chat"


def test_llama_arg_reaches_every_llama_server_row_and_no_other():
    specs = sbs.server_commands(sbs.parse_args(["--llama-arg=-nr", "--llama-arg=-fa"]))
    for name in ("llamacpp", "llamacpp-q8_0", "llamacpp-ngram", "llamacpp-draft"):
        argv = specs[name]["argv"]
        assert argv[argv.index("-nr") + 1] == "-fa"
    assert "-nr" not in specs["gapserve"]["argv"] and "-nr" not in specs["vllm"]["argv"]


def test_the_q8_0_row_serves_llama_servers_q8_0_file_on_gapserves_quantized_path():
    args = sbs.parse_args(["--llama-gguf-q8", "/m/smol-q8_0.gguf"])
    specs = sbs.server_commands(args)
    ours, theirs = specs["gapserve-q8_0"]["argv"], specs["llamacpp-q8_0"]["argv"]
    assert ours[ours.index("--model") + 1] == theirs[theirs.index("-m") + 1] \
        == "/m/smol-q8_0.gguf"
    assert "--dtype" not in ours  # the file's own path: its quantized kernels
    results = _results()
    results["servers"]["gapserve-q8_0"] = {"runs": [_run(300.0, 60.0)]}
    assert "gapserve-q8_0 / llamacpp-q8_0, medians: 1.50x at 64 concurrent, 1.50x single" \
        in sbs.markdown(results)


def test_each_row_shows_its_logprob_gap_beside_its_greedy_agreement():
    results = _results()
    results["servers"]["gapserve-bf16"]["logprob_gap"] = {
        "tokens": 512, "mean_abs_diff": 0.01234, "max_abs_diff": 2.2e-6, "top1_agreement": 0.99}
    rows = {line.split(" | ")[0]: line for line in sbs.markdown(results).splitlines()
            if line.startswith("| ")}
    assert "| 0.012 / 2.2e-06, top-1 99.0% of 512 |" in rows["| gapserve-bf16"]
    assert rows["| gapserve"].count(" | - | ") == 1  # measured nothing: a dash
