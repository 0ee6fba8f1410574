import pytest

from scheduler_svc.core import ConfigError, Scheduler, SchedulerConfig


def test_defaults_follow_the_reference_without_a_large_gpu():
    cfg = SchedulerConfig()
    cfg.validate()
    assert cfg.max_num_batched_tokens == 2048
    assert cfg.max_num_seqs == 256
    assert cfg.block_size == 16
    assert cfg.enable_chunked_prefill and cfg.enable_prefix_caching
    assert cfg.long_prefill_token_threshold == 0
    assert cfg.async_scheduling  # as the scheduler's --async-scheduling flag


def test_hash_seed_is_random_per_deployment_unless_pinned():
    assert SchedulerConfig().hash_seed != SchedulerConfig().hash_seed
    assert SchedulerConfig(hash_seed="x").hash_seed == "x"


def test_budget_must_cover_max_num_seqs_so_decoders_always_fit():
    with pytest.raises(ConfigError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32).validate()


def test_without_chunked_prefill_budget_must_cover_max_model_len():
    with pytest.raises(ConfigError, match="chunked prefill"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=2048,
                        max_model_len=4096).validate()
    SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=4096,
                    max_model_len=4096).validate()


@pytest.mark.parametrize("field,value", [
    ("max_num_seqs", 0), ("max_num_batched_tokens", -1), ("block_size", 0),
    ("max_model_len", 1), ("policy", "lifo"),
    ("long_prefill_token_threshold", -5), ("hash_seed", ""),
])
def test_bad_values_are_rejected_with_their_name(field, value):
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**{field: value}).validate()
    assert field.split("_")[0] in str(err.value)


def test_long_prefill_threshold_needs_chunked_prefill():
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=8192,
                        long_prefill_token_threshold=256).validate()


def test_scheduler_validates_config_at_start_up():
    with pytest.raises(ConfigError):
        Scheduler(SchedulerConfig(max_num_seqs=0), 100)


def test_pool_that_cannot_hold_one_max_length_request_is_a_config_error():
    with pytest.raises(ConfigError, match="max_model_len"):
        Scheduler(SchedulerConfig(max_model_len=1024, block_size=16), 1 + 63)
    Scheduler(SchedulerConfig(max_model_len=1024, block_size=16), 1 + 64)
