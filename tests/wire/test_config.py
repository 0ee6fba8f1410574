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


# ---------------------------------------------------------------------------
# a service's config built from its flag declarations (shared/flag_spec.from_flags)


def test_from_flags_takes_each_same_named_flag_and_keeps_the_default_when_unset():
    import argparse
    from dataclasses import dataclass

    from shared.flag_spec import add_flags, from_flags, group

    g = group("t")

    @dataclass(frozen=True)
    class Flags:
        size: int | None = g(None, type=int)
        speed: int = g(3, type=int)
        other_name: str = g("x")

    @dataclass
    class Config:
        size: int = 16
        speed: int = 1
        name: str = "n"
        fact: int = 0

    parser = argparse.ArgumentParser()
    add_flags(parser, Flags)
    cfg = from_flags(Config, parser.parse_args(["--other-name", "y"]), Flags,
                     renames={"name": "other_name"}, unset={"fact": 5, "size": 32})
    assert (cfg.size, cfg.speed, cfg.name, cfg.fact) == (32, 3, "y", 5)
    cfg = from_flags(Config, parser.parse_args(["--size", "8"]), Flags, unset={"size": 32})
    assert cfg.size == 8  # the flag wins over the fallback
    with pytest.raises(TypeError, match="no such field or flag"):
        from_flags(Config, parser.parse_args([]), Flags, renames={"name": "renamed_flag"})
    with pytest.raises(TypeError, match="no field"):
        from_flags(Config, parser.parse_args([]), Flags, unset={"typo": 1})


def _moved(cfg, base) -> set[str]:
    """The fields of cfg away from base's (a hash seed is drawn per start: never equal)."""
    from dataclasses import fields
    return {f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(base, f.name)}


def test_every_scheduler_config_field_but_the_hash_seed_is_a_flag_or_a_worker_fact():
    """Every scheduling flag away from its default, and the workers' facts away from the
    config's defaults: every field moves (hash_seed is drawn per start)."""
    from scheduler_svc.core.config import SchedulerConfig
    from scheduler_svc.server import scheduler_config
    from shared.types import ModelInfo

    info = ModelInfo("m", 100, 4096, [2], 2, 2, 16, "float32", 64, 32,
                     max_num_batched_tokens=999,
                     speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
                     sliding_window=256, long_prompt_rope_from=2048)
    moves = ["--max-num-seqs", "9", "--max-num-batched-tokens", "4096",
             "--max-model-len", "4000", "--no-long-prefill-exempt-lone-request",
             "--scheduling-policy", "priority", "--no-enable-prefix-caching",
             "--no-async-scheduling", "--num-scheduler-steps", "4"]
    # a long-prefill threshold needs chunked prefill: two configs move every flag
    one = scheduler_config(config.parse_args(
        config.scheduler_parser(), moves + ["--no-enable-chunked-prefill"], environ={}), info)
    two = scheduler_config(config.parse_args(
        config.scheduler_parser(), moves + ["--long-prefill-token-threshold", "64"],
        environ={}), info)
    base = SchedulerConfig()
    assert _moved(one, base) | _moved(two, base) == set(SchedulerConfig.__slots__)
    assert (one.max_num_seqs, one.max_num_batched_tokens, one.max_model_len, one.policy,
            one.num_scheduler_steps, one.block_size, two.long_prefill_token_threshold) == \
        (9, 4096, 4000, "priority", 4, 32, 64)
    # unset flags: the workers' facts, then the config's defaults
    cfg = scheduler_config(config.parse_args(config.scheduler_parser(), [], environ={}), info)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (256, 999, 4096)
    assert cfg.speculative_config.num_speculative_tokens == 2


def test_every_field_of_the_frontend_configs_is_its_flag():
    """RequestCaps, RoutingRule and ToolConfig, each flag away from its default: every
    field moves (the tools template comes from the model, not a flag)."""
    from frontend_svc.engine.replica_router import RoutingRule
    from frontend_svc.request.caps import RequestCaps
    from frontend_svc.structured.tools import ToolConfig

    args = config.parse_args(config.frontend_parser(), [
        "--max-client-batch-size", "2", "--max-choices-per-request", "3",
        "--max-stop-sequences", "4", "--max-stop-sequence-length", "5",
        "--max-stop-token-ids", "6", "--max-prompt-bytes", "7",
        "--data-parallel-routing", "round-robin", "--routing-cache-threshold", "0.5",
        "--routing-balance-abs-threshold", "8", "--routing-balance-rel-threshold", "2.5",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--trust-request-chat-template"], environ={})
    caps, rule = RequestCaps.from_args(args), RoutingRule.from_args(args)
    assert caps == RequestCaps(2, 3, 4, 5, 6, 7)
    assert rule == RoutingRule("round-robin", 0.5, 8, 2.5)
    tools = ToolConfig.from_args(args, None)
    assert _moved(tools, ToolConfig()) == {"enable_auto_tool_choice", "parser",
                                           "trust_request_chat_template"}
    unset = config.parse_args(config.frontend_parser(), [], environ={})
    assert (RequestCaps.from_args(unset), RoutingRule.from_args(unset),
            ToolConfig.from_args(unset, None)) == (RequestCaps(), RoutingRule(), ToolConfig())
