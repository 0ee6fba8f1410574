"""Gemma and Phi-3 configs: what each parses to, and every field this worker cannot
compute refused by name at load (never served wrongly, never a traceback)."""

from __future__ import annotations

import pytest

from tests.families.dense_checkpoints import write
from tests.families.test_registry import _edit_config
from worker_svc.model.config import layer_windows, load_model_config, model_config_from_hf


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    written = {}

    def get(name: str):
        if name not in written:
            written[name] = write(name, tmp_path_factory.mktemp(name))
        return written[name]
    return get


def test_a_gemma3_text_config_as_transformers_builds_it_from_a_gguf_file_parses():
    """transformers' GGUF loader builds Gemma3TextConfig from the file's metadata alone
    (no architectures, rope_theta as a keyword, the default layer pattern): the shape
    of Gemma 3 270M."""
    from transformers import Gemma3TextConfig
    hf = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                          num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                          head_dim=256, rope_theta=1e6, rms_norm_eps=1e-6, sliding_window=512,
                          max_position_embeddings=32768)
    cfg = model_config_from_hf(hf, [1, 106])
    assert (cfg.family, cfg.head_dim, cfg.num_kv_heads) == ("gemma", 256, 1)
    assert cfg.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(18))
    assert float(cfg.inv_freq[1]) == pytest.approx(1e6 ** (-2 / 256))  # the global base
    windows = layer_windows(cfg, 32768)
    assert windows[5] is None and windows[0] == 512


def test_gemma3_for_conditional_generation_serves_its_text_model(dense_dir):
    cfg = load_model_config(dense_dir("gemma3_multimodal_text"))
    assert cfg.model_type == "gemma3_text" and cfg.family == "gemma" and cfg.qk_norm


def test_phi3_longrope_and_phi4_partial_rotary_parse(dense_dir):
    phi3 = load_model_config(dense_dir("phi3_longrope"))
    assert phi3.long_from == 64 and phi3.rotary_dim is None
    assert not (phi3.long_inv_freq == phi3.inv_freq).all()
    phi4 = load_model_config(dense_dir("phi4_mini_partial_rotary"))
    assert phi4.rotary_dim == 12 and phi4.inv_freq.shape[0] == 6


@pytest.mark.parametrize("variant,changes,message", [
    ("gemma2", dict(hidden_activation="gelu"), "unsupported hidden_activation 'gelu'"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3_text", dict(layer_types=["sliding_attention", "chunked_attention",
                                      "full_attention", "sliding_attention"]),
     "unsupported layer_types"),
    ("gemma3_text", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "rope_type 'linear' for Gemma 3's sliding layers"),
    ("phi3_longrope", dict(hidden_act="gelu_new"), "unsupported hidden_act 'gelu_new'"),
    ("mistral_sliding_window", dict(rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}),
     "unsupported rope_type 'longrope' for mistral"),
    ("mistral_sliding_window", dict(rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial rotary embeddings \\(partial_rotary_factor 0.5\\) are not supported for "
     "mistral"),
])
def test_what_a_dense_family_cannot_compute_is_refused_by_name(dense_dir, tmp_path, variant,
                                                               changes, message):
    path = _edit_config(dense_dir(variant), tmp_path / "c", **changes)
    with pytest.raises(ValueError, match=message):
        load_model_config(path)
