"""Writes the benchmark's tiny-but-real-sized mixture of experts: a Qwen3-MoE
checkpoint with random weights (hidden 512, 8 experts top-2 of width 512, 8 layers,
8 query and 4 KV heads of 64), the default model's tokenizer and its 49,152-token
vocabulary, written as the Hub writes it (transformers' config class, save_pretrained).
Its text is noise; its steps cost what a real model of that shape costs.

    python benchmarks/tiny_moe_checkpoint.py /tmp/tiny-moe
    python benchmarks/side_by_side.py --model /tmp/tiny-moe --servers gapserve \
        --agreement-prompts 0
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def write(out: Path) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from shared.model_files.default_model import ensure_default_model
    config = Qwen3MoeConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=512, norm_topk_prob=True,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()  # transformers' init: N(0, 0.02)
    model.save_pretrained(str(out))
    source = ensure_default_model()
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and not (out / name).exists():
            shutil.copy(source / name, out / name)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    print(write(p.parse_args().out))
