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
# families whose configure() takes more: longrope and partial rotary (Phi-3)
LONGROPE_FAMILIES = ("phi3",)


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
    # which layers attend within sliding_window (Gemma alternates); None: all of them
    sliding_layers: tuple[bool, ...] | None = None
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of a head; None: all
    # longrope (Phi-3): positions from long_from on rotate with long_inv_freq
    long_inv_freq: torch.Tensor | None = None
    long_from: int | None = None
    hf_config: object = field(default=None, repr=False)


def layer_windows(cfg: ModelConfig, max_positions: int) -> list[int | None]:
    """Each layer's attention window, None where it sees every key. A window at least
    as long as the longest context served hides nothing: dropped, so such a model
    keeps the full-attention kernels."""
    window = cfg.sliding_window
    if window is None or window >= max_positions:
        return [None] * cfg.num_layers
    sliding = cfg.sliding_layers or (True,) * cfg.num_layers
    return [window if s else None for s in sliding]


def kv_window(cfg: ModelConfig, max_positions: int) -> int:
    """The window every layer's attention stays within (the widest, when all layers
    have one), 0 when some layer sees every key: keys further behind a query than this
    are read by no layer again, so the scheduler frees their blocks (shared/kv_window.py)."""
    windows = layer_windows(cfg, max_positions)
    return 0 if None in windows else max(windows)


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse config.json (through transformers' config classes, which standardize
    the RoPE parameters) and reject what our implementation does not handle."""
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(str(model_dir))
    return model_config_from_hf(hf, _eos_ids(model_dir, hf))


def model_config_from_hf(hf, eos_token_ids: list[int]) -> ModelConfig:
    """The ModelConfig of a transformers config object, however it was built (from
    config.json, or by transformers from a GGUF file's metadata)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from worker_svc.model.registry import family_of

    family = family_of(hf)
    if hf.model_type == "gemma3":  # Gemma3ForConditionalGeneration: serve its text model
        hf = hf.text_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    layer_type = None
    if "full_attention" in rope:  # per layer type (Gemma 3): the global layers' here
        layer_type, rope = "full_attention", dict(rope["full_attention"])
    rope_type = rope.get("rope_type", "default")
    longrope = family.name in LONGROPE_FAMILIES
    if rope_type not in SUPPORTED_ROPE_TYPES and not (longrope and rope_type == "longrope"):
        raise ValueError(f"unsupported rope_type {rope_type!r} for {hf.model_type}; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                         + (", longrope" if longrope else ""))
    partial = float(rope.get("partial_rotary_factor", 1.0) or 1.0)
    if partial != 1.0 and not longrope:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor {partial}) are "
                         f"not supported for {hf.model_type}")
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {partial} of head_dim {head_dim} gives an "
                         f"unusable rotary dimension {rotary_dim}")
    if rope_type == "default":
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float)
                                    / rotary_dim))
        rope_scaling = 1.0
    else:
        kw = {"layer_type": layer_type} if layer_type else {}
        inv_freq, rope_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", **kw)
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
        eos_token_ids=eos_token_ids,
        inv_freq=inv_freq.float(),
        rope_scaling=float(rope_scaling),
        max_context=rope_context(hf.max_position_embeddings, rope_type, rope),
        family=family.name,
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
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
