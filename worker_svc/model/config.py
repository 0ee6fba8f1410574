"""Model facts read from a checkpoint's config.json, in the shape our model needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

# model_type -> whether q/k/v projections carry a bias regardless of config flags
SUPPORTED_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": True}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: list[int]
    inv_freq: torch.Tensor  # [head_dim // 2] fp32 RoPE inverse frequencies
    rope_scaling: float  # multiplies cos/sin (yarn's attention factor), 1.0 otherwise
    sliding_window: int | None = None
    hf_config: object = field(default=None, repr=False)


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse config.json (through transformers' config classes, which standardize
    the RoPE parameters) and reject what our implementation does not handle."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoConfig.from_pretrained(str(model_dir))
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {hf.model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}; only silu (SwiGLU)")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        rope_scaling = 1.0
    else:
        inv_freq, rope_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    sliding_window = None
    if hf.model_type == "mistral" and getattr(hf, "sliding_window", None):
        sliding_window = int(hf.sliding_window)
    if hf.model_type == "qwen2" and getattr(hf, "use_sliding_window", False):
        raise ValueError("Qwen2 sliding-window attention is not supported")
    return ModelConfig(
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(model_dir, hf),
        inv_freq=inv_freq.float(),
        rope_scaling=float(rope_scaling),
        sliding_window=sliding_window,
        hf_config=hf,
    )


def _eos_ids(model_dir: Path, hf) -> list[int]:
    """EOS ids from generation_config.json where present (chat models often list
    several there), else from config.json."""
    ids: list[int] = []
    try:
        from transformers import GenerationConfig
        gen = GenerationConfig.from_pretrained(str(model_dir))
        ids = _as_list(gen.eos_token_id)
    except OSError:
        pass
    return ids or _as_list(getattr(hf, "eos_token_id", None))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
