"""Tiny random-weight checkpoints (Llama with GQA and tied embeddings, Qwen2 with
q/k/v bias and untied head), written once per session."""

from __future__ import annotations

import pytest
import torch


def _write_checkpoint(path, config_cls, model_cls, max_shard_size=None, **overrides):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    base.update(overrides)
    config = config_cls(**base)
    torch.manual_seed(1234)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger random weights than the default init: sharper logits
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    if max_shard_size is None:
        model.save_pretrained(str(path))
    else:
        model.save_pretrained(str(path), max_shard_size=max_shard_size)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    return _write_checkpoint(tmp_path_factory.mktemp("tiny_llama"), LlamaConfig,
                             LlamaForCausalLM, tie_word_embeddings=True, rope_theta=10000.0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _write_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), Qwen2Config,
                             Qwen2ForCausalLM, tie_word_embeddings=False,
                             rope_theta=1000000.0, use_sliding_window=False)


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 500000.0}
    return _write_checkpoint(tmp_path_factory.mktemp("tiny_llama3"), LlamaConfig,
                             LlamaForCausalLM, tie_word_embeddings=False,
                             rope_parameters=rope)


@pytest.fixture(scope="session")
def tiny_mistral_sharded_dir(tmp_path_factory):
    """Mistral with yarn RoPE scaling, saved in several safetensors shards."""
    from transformers import MistralConfig, MistralForCausalLM
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
            "rope_theta": 10000.0}
    return _write_checkpoint(tmp_path_factory.mktemp("tiny_mistral"), MistralConfig,
                             MistralForCausalLM, max_shard_size="100KB",
                             tie_word_embeddings=False, sliding_window=None,
                             rope_parameters=rope)

