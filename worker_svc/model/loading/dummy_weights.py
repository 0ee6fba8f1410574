"""--load-format dummy: random weights of the checkpoint's real shapes, as vLLM's.

The config.json is read as usual and no weight file is opened, so a benchmark can
run the real model's shapes and step times without the weights (or with a config
alone), and the serving stack can be measured on its own (--zero-cost-steps).
Values are uniform in [-1e-3, 1e-3] like vLLM's dummy loader (norms at 1), small
enough that activations stay finite through any depth; the outputs mean nothing.
"""

from __future__ import annotations

import torch

from worker_svc.model.config import ModelConfig
from worker_svc.model.loading.weights import LayerWeights, ModelWeights

LOW, HIGH = -1e-3, 1e-3


def dummy_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  seed: int = 0) -> ModelWeights:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        t = torch.empty(*shape, dtype=torch.float32).uniform_(LOW, HIGH, generator=gen)
        return t.to(device=device, dtype=dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    hf = cfg.hf_config
    qkv_bias = cfg.qkv_bias or bool(getattr(hf, "attention_bias", False))
    mlp_bias = bool(getattr(hf, "mlp_bias", False))
    h, inter = cfg.hidden_size, cfg.intermediate_size
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = [LayerWeights(
        input_norm=ones(h), qkv=rand(nq + 2 * nkv, h),
        qkv_bias=rand(nq + 2 * nkv) if qkv_bias else None,
        o_proj=rand(h, nq), o_bias=rand(h) if getattr(hf, "attention_bias", False) else None,
        post_norm=ones(h), gate_up=rand(2 * inter, h),
        gate_up_bias=rand(2 * inter) if mlp_bias else None,
        down=rand(h, inter), down_bias=rand(h) if mlp_bias else None,
    ) for _ in range(cfg.num_layers)]
    embed = rand(cfg.vocab_size, h)
    lm_head = embed if cfg.tie_word_embeddings else rand(cfg.vocab_size, h)
    return ModelWeights(embed=embed, layers=layers, final_norm=ones(h), lm_head=lm_head)
