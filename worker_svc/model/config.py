"""Model facts read from a checkpoint's config.json, in the shape our model needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

# model_type -> whether q/k/v projections carry a bias regardless of config flags
SUPPORTED_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": True, "phi3": False,
                         "gemma2": False, "gemma3_text": False, "gemma3": False}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
GEMMA_TYPES = ("gemma2", "gemma3_text")  # the layer of worker_svc/model/gemma.py


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
    # "llama" (Llama, Mistral, Qwen2, Phi-3: model/llama.py, the C ops can run it) or
    # "gemma" (Gemma 2/3: model/gemma.py, torch ops)
    family: str = "llama"
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of a head; None: all
    # longrope (Phi-3): positions from long_from on rotate with long_inv_freq
    long_inv_freq: torch.Tensor | None = None
    long_from: int | None = None
    # which layers attend within sliding_window (Gemma alternates); None: all of them
    sliding_layers: tuple[bool, ...] | None = None
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

    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {hf.model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.model_type == "gemma3":  # Gemma3ForConditionalGeneration: serve its text model
        hf = hf.text_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if hf.model_type in GEMMA_TYPES:
        from worker_svc.model import gemma
        gemma.check_config(hf)
        rope = dict(hf.rope_parameters.get("full_attention", hf.rope_parameters)) \
            if hf.model_type == "gemma3_text" else dict(hf.rope_parameters or {})
        layer_type = "full_attention" if hf.model_type == "gemma3_text" else None
    else:
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}; only silu (SwiGLU)")
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        layer_type = None
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES or (rope_type == "longrope"
                                                 and hf.model_type != "phi3"):
        raise ValueError(f"unsupported rope_type {rope_type!r} for {hf.model_type}; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES[:-1])}, and longrope "
                         "for phi3")
    partial = float(rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor",
                                                                1.0) or 1.0))
    if partial != 1.0 and hf.model_type != "phi3":
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor {partial}) are "
                         f"not supported for {hf.model_type}; only for phi3")
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {partial} of head_dim {head_dim} gives an "
                         f"unusable rotary dimension {rotary_dim}")
    kw = {"layer_type": layer_type} if layer_type else {}
    long_inv_freq = long_from = None
    if rope_type == "default":
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float)
                                    / rotary_dim))
        rope_scaling = 1.0
    else:
        inv_freq, rope_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", **kw)
    if rope_type == "longrope":
        from worker_svc.model import phi3
        long_inv_freq, long_from = phi3.long_rope(hf)
    sliding_window, sliding_layers = None, None
    if hf.model_type in ("mistral", "phi3") and getattr(hf, "sliding_window", None):
        sliding_window = int(hf.sliding_window)
    if hf.model_type in GEMMA_TYPES and getattr(hf, "sliding_window", None):
        sliding_window = int(hf.sliding_window)
        sliding_layers = tuple(t == "sliding_attention" for t in hf.layer_types)
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
        eos_token_ids=eos_token_ids,
        inv_freq=inv_freq.float(),
        rope_scaling=float(rope_scaling),
        sliding_window=sliding_window,
        sliding_layers=sliding_layers,
        family="gemma" if hf.model_type in GEMMA_TYPES else "llama",
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        long_inv_freq=long_inv_freq,
        long_from=long_from,
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
