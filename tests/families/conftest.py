"""Tiny random checkpoints of each model family and variant, written as the Hub
writes them (transformers' config classes and save_pretrained), once per session.
Weights (norms included) are drawn wider than the default init, so the per-head q/k
norms, the RoPE variant, biases and the router's choices all change greedy tokens."""

from __future__ import annotations

import pytest
import torch


def _write_checkpoint(path, config_cls, model_cls, **overrides):
    """tests/worker/conftest.py's base shape; every weight N(0, 0.08) except the norms,
    N(1, 0.3), and the per-head q/k norms, N(4, 1): attention scores wide enough that
    the RoPE variant and the norms move the greedy choice."""
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    base.update(overrides)
    config = config_cls(**base)
    torch.manual_seed(1234)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(4.0, 1.0)
            elif "norm" in name:
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path))
    return path


# name -> (config class, model class, overrides); the base is _write_checkpoint's
# (vocab 256, hidden 64, 3 layers, 4 heads, 2 KV heads)
VARIANTS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3_untied_bias": ("Qwen3Config", "Qwen3ForCausalLM",
                          dict(head_dim=16, attention_bias=True, tie_word_embeddings=False,
                               max_position_embeddings=256,
                               rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 64,
                                                "rope_theta": 10000.0})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, tie_word_embeddings=False)),
    # 5 experts: two tensor-parallel ranks hold 3 and 2; layer 1 of 3 is sparse
    "qwen3_moe_unnormalized_sparse_step": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=48,
             norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
             tie_word_embeddings=True)),
    # use_sliding_window: layers from max_window_layers 1 on attend within 24 tokens
    "qwen3_sliding_layers": ("Qwen3Config", "Qwen3ForCausalLM",
                             dict(head_dim=16, use_sliding_window=True, sliding_window=24,
                                  max_window_layers=1, tie_word_embeddings=False)),
    # every layer windowed (Qwen3-MoE has no max_window_layers rule): blocks are freed
    "qwen3_moe_sliding_window": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                 dict(num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, norm_topk_prob=True,
                                      use_sliding_window=True, sliding_window=24,
                                      tie_word_embeddings=False)),
    # Qwen1.5-MoE's layout: a shared expert with its sigmoid gate beside 4 routed
    # experts top-2 unnormalised; layer 0 dense (mlp_only_layers), q/k/v bias
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=False,
                       mlp_only_layers=[0], tie_word_embeddings=False)),
    # normalised top-k, every second layer sparse (decoder_sparse_step 2)
    "qwen2_moe_normalized_sparse_step": (
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=32,
             shared_expert_intermediate_size=40, norm_topk_prob=True,
             decoder_sparse_step=2, tie_word_embeddings=True)),
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


def write_variant(path, name: str, served: bool = False):
    """served: with the default model's tokenizer and its 49152-token vocabulary, for
    the stack's frontend (tests/integration/tiny_model.py's files)."""
    import shutil

    import transformers

    from shared.model_files.default_model import ensure_default_model
    from tests.integration.tiny_model import TOKENIZER_FILES
    config_cls, model_cls, overrides = VARIANTS[name]
    if served:
        overrides = dict(overrides, vocab_size=49152)
    _write_checkpoint(path, getattr(transformers, config_cls),
                      getattr(transformers, model_cls), **overrides)
    if served:
        source = ensure_default_model()
        for file in TOKENIZER_FILES:
            if (source / file).is_file():
                shutil.copy(source / file, path / file)
    return path


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
def served_family_dir(tmp_path_factory):
    """served_family_dir(name): the variant with a real tokenizer (write_variant)."""
    written = {}

    def get(name: str):
        if name not in written:
            written[name] = write_variant(tmp_path_factory.mktemp(f"served_{name}"), name,
                                          served=True)
        return written[name]
    return get

