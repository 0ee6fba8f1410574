"""Model facts read from a checkpoint's config.json, in the shape our model needs.

The shared fields (sizes, heads, RoPE, EOS) are read here for every family; the
family module the registry picks (worker_svc/model/registry.py) reads its own fields
and refuses what it cannot run (its `configure`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker_svc.model.layers import MoeSpec

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
    # the positions the RoPE serves: max_position_embeddings, or more where the
    # config's scaling extends it (yarn: original_max_position_embeddings * factor)
    max_context: int = 0
    sliding_window: int | None = None
    family: str = "llama"  # the registry's family (worker_svc/model/<family>.py)
    # family fields, set by the family's configure()
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    moe: MoeSpec | None = None  # the routed-experts layers' shape and router
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or a dense MLP
    hf_config: object = field(default=None, repr=False)


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse config.json (through transformers' config classes, which standardize
    the RoPE parameters) and reject what our implementation does not handle."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from worker_svc.model.registry import family_of

    hf = AutoConfig.from_pretrained(str(model_dir))
    family = family_of(hf)
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
    cfg = ModelConfig(
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
        max_context=rope_context(hf.max_position_embeddings, rope_type, rope),
        family=family.name,
        hf_config=hf,
    )
    return family.module().configure(hf, cfg)


def require_silu(hf) -> None:
    """A SwiGLU family's refusal of any other MLP activation (a family with its own,
    such as Gemma's GeGLU, checks for that one instead)."""
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf.hidden_act!r} for model_type "
                         f"{hf.model_type!r}; only silu (SwiGLU)")


def rope_context(max_position_embeddings: int, rope_type: str, rope: dict) -> int:
    """The positions a checkpoint serves. YaRN's tables are static, so a config that
    scales pretraining's original_max_position_embeddings by `factor` serves that many
    (Qwen2.5's 32K x 4 = 128K, as vLLM derives it); every other type, the config's
    max_position_embeddings (llama3's already states its extended length)."""
    if rope_type == "yarn" and rope.get("factor") and rope.get("original_max_position_embeddings"):
        scaled = int(rope["original_max_position_embeddings"] * rope["factor"])
        return max(max_position_embeddings, scaled)
    return max_position_embeddings


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
