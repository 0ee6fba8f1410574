"""Every flag also reads GAPSERVE_<FLAG>; the flag wins over it, it over the default."""

import pytest

from shared import config
from shared.flag_spec import env_name


def test_env_name_is_the_flag_in_upper_snake_case():
    assert env_name("--max-num-seqs") == "GAPSERVE_MAX_NUM_SEQS"


def test_default_applies_without_flag_or_env():
    args = config.parse_args(config.scheduler_parser(), [], environ={})
    assert args.port == 50052 and args.enable_prefix_caching is True


def test_env_wins_over_default_and_flag_wins_over_env():
    env = {"GAPSERVE_PORT": "6000", "GAPSERVE_MAX_NUM_SEQS": "7"}
    args = config.parse_args(config.scheduler_parser(), [], environ=env)
    assert (args.port, args.max_num_seqs) == (6000, 7)
    args = config.parse_args(config.scheduler_parser(), ["--port", "6001"], environ=env)
    assert (args.port, args.max_num_seqs) == (6001, 7)


def test_boolean_flags_read_env_and_negated_flag_wins():
    env = {"GAPSERVE_ENABLE_PREFIX_CACHING": "false"}
    assert not config.parse_args(config.scheduler_parser(), [], environ=env).enable_prefix_caching
    args = config.parse_args(config.scheduler_parser(), ["--enable-prefix-caching"], environ=env)
    assert args.enable_prefix_caching


def test_list_flag_reads_env():
    env = {"GAPSERVE_WORKER_ADDRESSES": "a:1, b:2"}
    args = config.parse_args(config.scheduler_parser(), [], environ=env)
    assert args.worker_addresses == ["a:1", "b:2"]


@pytest.mark.parametrize("env", [{"GAPSERVE_PORT": "x"}, {"GAPSERVE_PORT": "70000"},
                                 {"GAPSERVE_SCHEDULING_POLICY": "lifo"},
                                 {"GAPSERVE_ASYNC_SCHEDULING": "maybe"}])
def test_bad_env_value_is_a_usage_error_naming_the_variable(env, capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_args(config.scheduler_parser(), [], environ=env)
    assert e.value.code == 2
    assert next(iter(env)) in capsys.readouterr().err


def test_parsing_leaves_the_parser_defaults_unchanged():
    parser = config.worker_parser()
    config.parse_args(parser, [], environ={"GAPSERVE_BLOCK_SIZE": "32"})
    assert config.parse_args(parser, [], environ={}).block_size == 16


def test_link_security_needs_cert_and_key_together_and_reads_the_token():
    import argparse

    import pytest

    from shared.link_security import LinkSecurity

    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        LinkSecurity.from_args(argparse.Namespace(tls_cert="c.pem", tls_key=None))
    plain = LinkSecurity.from_args(config.parse_args(
        config.worker_parser(), [], environ={"GAPSERVE_INTERNAL_TOKEN": "t"}))
    assert not plain.tls and plain.server_credentials() is None
    assert plain.metadata == (("x-gapserve-internal-token", "t"),)
    assert LinkSecurity.from_args(config.parse_args(
        config.worker_parser(), [], environ={"GAPSERVE_INTERNAL_TOKEN": ""})).metadata == ()
