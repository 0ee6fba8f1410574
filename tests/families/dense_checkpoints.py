"""Tiny random checkpoints of every dense family and variant, written as the Hub writes
them (transformers' config classes and save_pretrained), with weights large enough
that RoPE bases and scaling, norms, soft-caps and windows change greedy tokens."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 24  # the sliding window of the windowed variants: prompts run past it


def _longrope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.9 * i for i in range(half)]}


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM, MistralConfig(**BASE, sliding_window=WINDOW,
                                             tie_word_embeddings=False)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM, Gemma2Config(
        **BASE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        final_logit_softcapping=2.0, attn_logit_softcapping=1.5, rope_theta=10000.0,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False)


def _gemma3_text():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
    return Gemma3ForCausalLM, Gemma3TextConfig(
        **BASE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"], rope_parameters=rope,
        final_logit_softcapping=None, tie_word_embeddings=False)


def _gemma3_text_softcap():
    model_cls, cfg = _gemma3_text()
    cfg.final_logit_softcapping = 2.0
    cfg.tie_word_embeddings = True  # as the Hub's Gemma 3 checkpoints are
    return model_cls, cfg


def _gemma3_multimodal():
    """Gemma3ForConditionalGeneration: a tiny vision tower beside the text model, whose
    weights sit under model.language_model."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration,
                              SiglipVisionConfig)
    _, text = _gemma3_text()
    text.tie_word_embeddings = True
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    return Gemma3ForConditionalGeneration, Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        boi_token_index=253, eoi_token_index=254, image_token_index=255,
        eos_token_id=2, bos_token_id=1, pad_token_id=0)


def _phi3_longrope():
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM, Phi3Config(**BASE, rope_parameters=_longrope(16),
                                       original_max_position_embeddings=64,
                                       sliding_window=None, tie_word_embeddings=False)


def _phi4_mini():
    from transformers import Phi3Config, Phi3ForCausalLM
    rope = {**_longrope(12), "partial_rotary_factor": 0.75}
    return Phi3ForCausalLM, Phi3Config(**BASE, rope_parameters=rope, sliding_window=None,
                                       original_max_position_embeddings=64,
                                       tie_word_embeddings=True)


VARIANTS = {"mistral_sliding_window": _mistral, "gemma2": _gemma2,
            "gemma3_text": _gemma3_text, "gemma3_text_softcap": _gemma3_text_softcap,
            "gemma3_multimodal_text": _gemma3_multimodal,
            "phi3_longrope": _phi3_longrope, "phi4_mini_partial_rotary": _phi4_mini}


def write(name: str, out: Path) -> Path:
    model_cls, config = VARIANTS[name]()
    torch.manual_seed(1234)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger than the default init: sharper logits
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(str(out))
    return out


def reference(path: Path):
    """transformers' own model, eager attention (the one path that soft-caps scores)."""
    import json

    import transformers
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()
