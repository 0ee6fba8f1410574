"""vLLM's command-line habits (issue 44 item 2): `gapserve serve MODEL`, --port and
--host, a mistyped flag answered in one line, a hub id explained in one line."""

import pytest

from gapserve import serve
from gapserve.serve import children, serve_parser
from shared import config
from shared.model_files.default_model import MODEL_DIR_NAME, looks_like_hub_id, resolve_model


def serve_args(argv):
    parser = serve_parser()
    args = config.parse_args(parser, argv, environ={})
    config.model_from_args(parser, args)
    return args


def test_serve_takes_the_model_as_a_positional_argument(tmp_path):
    assert serve_args([str(tmp_path)]).model == str(tmp_path)
    assert serve_args(["--model", str(tmp_path)]).model == str(tmp_path)
    assert serve_args([str(tmp_path), "--model", str(tmp_path)]).model == str(tmp_path)


def test_two_different_models_are_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        serve_args([str(tmp_path), "--model", "/elsewhere"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "given twice" in err


def test_port_is_the_http_port_and_the_old_name_still_works():
    assert serve_args(["--port", "8080"]).http_port == 8080
    assert serve_args(["--http-port", "8081"]).http_port == 8081
    assert config.parse_args(config.frontend_parser(), ["--port", "8082"], environ={}) \
        .http_port == 8082


def test_port_and_host_reach_the_frontend_child():
    args = serve_args(["/m", "--port", "8080", "--host", "0.0.0.0"])
    args.instance_id = "i"
    frontend = next(c for c in children(args) if c.name == "frontend")
    forwarded = config.parse_args(config.frontend_parser(), frontend.argv[1:], environ={})
    assert (forwarded.http_port, forwarded.host) == (8080, "0.0.0.0")


@pytest.mark.parametrize("make", [serve_parser, config.worker_parser,
                                  config.scheduler_parser, config.frontend_parser])
def test_an_unknown_flag_is_one_line_naming_the_closest_flag(make, capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_args(make(), ["--max-num-seqz", "4"] if make is not config.frontend_parser
                          else ["--prot", "8080"], environ={})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "unknown flag" in err and ("did you mean --max-num-seqs?" in err
                                      or "did you mean --port?" in err)


def test_a_flag_like_nothing_known_is_one_line_pointing_at_help(capsys):
    with pytest.raises(SystemExit):
        config.parse_args(serve_parser(), ["--zzzzzzzz"], environ={})
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gapserve serve --help" in err


def test_a_bad_value_is_one_line_without_the_usage(capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_args(serve_parser(), ["--max-num-seqs", "x"], environ={})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-num-seqs" in err and "usage" not in err


def test_a_hub_id_is_recognized_only_when_no_such_local_path_exists(tmp_path, monkeypatch):
    assert looks_like_hub_id("Qwen/Qwen3-0.6B")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not looks_like_hub_id("org/name")
    assert not looks_like_hub_id("./x/y") and not looks_like_hub_id("/abs/path")


def test_a_hub_id_says_only_local_checkpoints_are_served_and_names_the_default():
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("Qwen/Qwen3-0.6B")
    message = str(e.value)
    assert "local checkpoints only" in message and MODEL_DIR_NAME in message
    assert "gapserve serve ./Qwen3-0.6B" in message and "\n" not in message


def test_serve_refuses_a_hub_id_in_one_line_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as e:
        serve.main(["Qwen/Qwen3-0.6B"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Hugging Face hub id" in err
