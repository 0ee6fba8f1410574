"""A tiny Llama checkpoint with random weights and the default model's real
tokenizer (the frontend needs text), written like any Hugging Face checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


def write_tiny_llama(out_dir: Path, *, seed: int = 0, num_layers: int = 2,
                     max_position_embeddings: int = 1024) -> Path:
    """Write the checkpoint into out_dir (created) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.model_files.default_model import ensure_default_model

    source = ensure_default_model()
    out_dir.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=2,
        # wider than the default 0.02, so greedy choices are not near-ties
        initializer_range=0.2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out_dir / name)
    return out_dir


def tiny_llama_dir() -> Path:
    """The tiny checkpoint, written once into the gapserve cache (tests reuse it)."""
    import os
    import tempfile

    from shared.model_files.default_model import cache_dir

    target = cache_dir() / "test-tiny-llama-v1"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-"))
    write_tiny_llama(tmp / target.name)
    try:
        os.rename(tmp / target.name, target)
    except OSError:  # another process won the race: its copy is the same
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    return target
