"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, with
the `gguf` package's GGUFWriter: a tiny random transformers checkpoint's tensors under
GGUF names (llama's q/k rows permuted, Gemma's norms stored as 1 + w), quantized with
gguf.quants.quantize (K-quants: hand-made blocks, which quantize does not write), a
byte-level BPE tokenizer and a chat template in the metadata."""

from __future__ import annotations

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as T

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          # phi3 keeps its checkpoint's fused layout
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
          # qwen3moe: the router and the experts stacked (_split_experts' names)
          "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_exps": "ffn_gate_exps",
          "mlp.experts.up_exps": "ffn_up_exps", "mlp.experts.down_exps": "ffn_down_exps"}
_POST_ATTN = {"llama": "ffn_norm", "qwen2": "ffn_norm", "qwen3": "ffn_norm",
              "phi3": "ffn_norm", "qwen3moe": "ffn_norm",
              "gemma2": "post_attention_norm", "gemma3": "post_attention_norm"}
_GEMMA = {"pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}
# byte offsets of the fp16 scale fields in each K-quant block (the rest: random bits)
_K_SCALES = {T.Q2_K: (84, (80, 82)), T.Q3_K: (110, (108,)), T.Q4_K: (144, (0, 2)),
             T.Q5_K: (176, (0, 2)), T.Q6_K: (210, (208,))}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the token text of each of the 256 bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) \
        + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tokens() -> list[str]:
    return ["<unk>", "<s>", "</s>"] + _bytes_to_unicode() + ["Ġt", "he"]  # vocab 261


def _gguf_name(hf: str, arch: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    part, _, suffix = rest.rpartition(".")
    if part == "post_attention_layernorm":
        name = _POST_ATTN[arch]
    else:
        name = _GEMMA.get(part) or _BLOCK[part]
    return f"blk.{layer}.{name}.{suffix}"


def _k_blocks(kind: T, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant blocks with small finite fp16 scales."""
    size, scale_at = _K_SCALES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for at in scale_at:
        scales = rng.uniform(0.001, 0.01, size=(rows, cols // 256)).astype(np.float16)
        raw[:, :, at:at + 2] = scales.view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


def _split_experts(state: dict) -> dict:
    """transformers' fused experts ([E, 2I, H] gate_up, [E, H, I] down) as llama.cpp's
    stacked ffn_{gate,up,down}_exps, under stand-in names _gguf_name maps."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            out[name.replace("gate_up_proj", "gate_exps.weight")] = t[:, :half]
            out[name.replace("gate_up_proj", "up_exps.weight")] = t[:, half:]
        elif name.endswith("mlp.experts.down_proj"):
            out[name.replace("down_proj", "down_exps.weight")] = t
        else:
            out[name] = t
    return out


def write_gguf(model, path, arch: str, kind: T = T.F32) -> None:
    """`model` (a transformers causal LM) as a GGUF of architecture `arch`, its 2-D
    weights stored as `kind`, norms as F32 (as llama.cpp keeps them)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type; GGUF: the global one
    w.add_rope_freq_base(rope["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens())
    w.add_token_types([3, 3, 3] + [1] * 258)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if arch == "phi3":  # else transformers' Phi3Config default (32000) is past the vocab
        w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(7)
    for hf, t in _split_experts(model.state_dict()).items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.detach().to(torch.float32).numpy().copy()
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf else cfg.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]) \
                .swapaxes(1, 2).reshape(data.shape)  # llama.cpp's converter's permute
        if arch in ("gemma2", "gemma3") and hf.endswith("norm.weight"):
            data = data + 1  # llama.cpp's converter stores Gemma norms as 1 + w
        name = _gguf_name(hf, arch)
        if data.ndim == 1 or kind == T.F32:
            w.add_tensor(name, data.astype(np.float32))
        elif kind == T.F16:
            w.add_tensor(name, data.astype(np.float16))
        elif data.ndim == 3:  # stacked experts: quantized per expert
            w.add_tensor(name, np.stack([gguf.quants.quantize(d, kind) for d in data]),
                         raw_dtype=kind)
        elif kind in _K_SCALES:
            raw = _k_blocks(kind, data.shape[0], data.shape[1], rng)
            w.add_tensor(name, raw, raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
