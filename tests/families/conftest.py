"""Tiny random checkpoints of each model family and variant, written as the Hub
writes them (transformers' config classes and save_pretrained), once per session.
Weights (norms included) are drawn wider than the default init, so the per-head q/k
norms, the RoPE variant, biases and the router's choices all change greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tests.worker.conftest import _write_checkpoint

# name -> (config class, model class, overrides); the base is _write_checkpoint's
# (vocab 256, hidden 64, 3 layers, 4 heads, 2 KV heads)
VARIANTS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3_untied_bias": ("Qwen3Config", "Qwen3ForCausalLM",
                          dict(head_dim=16, attention_bias=True, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 64,
                                                "rope_theta": 10000.0})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, tie_word_embeddings=False)),
    "qwen3_moe_unnormalized_sparse_step": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
             norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
             tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96,
                     tie_word_embeddings=False, sliding_window=None)),
    # Qwen2.5's long-context recipe: YaRN over the original 64 positions, x4
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(max_position_embeddings=64, use_sliding_window=False,
                        tie_word_embeddings=False,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 64,
                                         "rope_theta": 10000.0})),
}


def write_variant(path, name: str):
    import transformers
    config_cls, model_cls, overrides = VARIANTS[name]
    return _write_checkpoint(path, getattr(transformers, config_cls),
                             getattr(transformers, model_cls), **overrides)


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """family_dir(name) -> the variant's checkpoint directory, written on first use."""
    written = {}

    def get(name: str):
        if name not in written:
            written[name] = write_variant(tmp_path_factory.mktemp(name), name)
        return written[name]
    return get


@pytest.fixture(scope="session")
def hf_family():
    """transformers' float32 model of a checkpoint directory, loaded once."""
    from transformers import AutoModelForCausalLM
    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch.float32).eval()
        return cache[path]
    return get
