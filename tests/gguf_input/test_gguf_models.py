"""GGUF files served directly: a tiny random checkpoint of each family written as a
GGUF in each tensor type computes the logits transformers' own `gguf_file=` load of
the same file computes (dequantized, float32); the tokenizer and chat template come
from the file; unsupported tensor types and architectures are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as T
from shared.model_files.gguf_model import GGUFError, check_gguf, find_gguf
from tests.gguf_input.gguf_files import CHAT_TEMPLATE, write_gguf
from tests.worker.test_model_matches_transformers import (_chunk_logits, _prompt,
                                                          _relative_error, _state)
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner

_BASE = dict(vocab_size=261, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)
# GGUF architecture -> (config class, model class, overrides)
_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # transformers reads no head_dim from a qwen3 GGUF (its default, 128, holds)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True,
                                                      head_dim=128)),
    # transformers reads no soft-caps or query_pre_attn_scalar from a gemma2 GGUF:
    # its defaults (50, 30, 256) hold, for us as for it
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(tie_word_embeddings=True, sliding_window=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False)),
    # transformers reads no expert_feed_forward_length: its default (768, Qwen3-30B-A3B's)
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 dict(tie_word_embeddings=False, head_dim=128, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=768)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(tie_word_embeddings=True, sliding_window=16, layer_types=None)),
}
_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
          T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GAPSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _tiny(arch: str):
    import transformers
    config_cls, model_cls, overrides = _FAMILIES[arch]
    config = getattr(transformers, config_cls)(**{**_BASE, **overrides})
    torch.manual_seed(1234)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3) if not arch.startswith("gemma") else p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.08)
    return model


def _gguf(tmp_path, arch: str, kind: T):
    path = tmp_path / "model" / f"tiny-{arch}-{kind.name}.gguf"
    path.parent.mkdir(parents=True)
    write_gguf(_tiny(arch), path, arch, kind)
    return path


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def _logits_match(path) -> None:
    # --dtype float32: the exact path (a quantized file's default is the quantized
    # one, tests/gguf_input/test_gguf_quantized.py)
    runner = ModelRunner(WorkerConfig(model=str(path), device="cpu", max_model_len=256,
                                      num_gpu_blocks_override=64, max_num_seqs=8,
                                      dtype="float32"))
    prompt = [t % 261 for t in _prompt(0, 40)]
    got = _chunk_logits(runner, _state(prompt), len(prompt))
    with torch.no_grad():
        want = _hf(path)(torch.tensor([prompt])).logits[0]
    assert _relative_error(got, want) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))  # greedy: token-equal


@pytest.mark.parametrize("kind", _TYPES, ids=lambda k: k.name)
def test_every_common_tensor_type_serves_transformers_gguf_logits(tmp_path, kind):
    _logits_match(_gguf(tmp_path, "llama", kind))


@pytest.mark.parametrize("arch", [a for a in _FAMILIES if a != "llama"])
def test_each_family_gguf_serves_transformers_gguf_logits(tmp_path, arch):
    _logits_match(_gguf(tmp_path, arch, T.Q8_0))


def test_tokenizer_and_chat_template_come_from_the_gguf(tmp_path):
    from transformers import AutoTokenizer

    from frontend_svc.request.tokenizer import TextTokenizer
    from shared.model_files.default_model import resolve_model
    path = _gguf(tmp_path, "qwen2", T.F16)
    view = resolve_model(str(path))
    ours = TextTokenizer.from_dir(view)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Hello GGUF, the quick brown fox: 42!"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.chat_template.source == CHAT_TEMPLATE
    assert resolve_model(str(path.parent)) == view  # a directory holding one GGUF


def test_iq_tensor_type_is_refused_by_name(tmp_path):
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    # 4 rows of 256 values: 8 IQ4_NL blocks of 18 bytes each
    w.add_tensor("token_embd.weight", np.zeros((4, 144), dtype=np.uint8), raw_dtype=T.IQ4_NL)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match="token_embd.weight has GGUF type IQ4_NL"):
        check_gguf(path)


def test_a_phi3_gguf_with_longrope_factors_is_refused_by_name(tmp_path):
    path = tmp_path / "longrope.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="longrope factors"):
        check_gguf(path)


def test_a_qwen3moe_gguf_whose_expert_width_transformers_misreads_is_refused(tmp_path):
    import transformers
    from shared.model_files.gguf_model import ensure_view
    config_cls, model_cls, overrides = _FAMILIES["qwen3moe"]
    config = transformers.Qwen3MoeConfig(**{**_BASE, **overrides, "moe_intermediate_size": 64})
    torch.manual_seed(0)
    path = tmp_path / "model" / "moe64.gguf"
    path.parent.mkdir()
    write_gguf(transformers.Qwen3MoeForCausalLM(config).eval(), path, "qwen3moe")
    with pytest.raises(GGUFError, match="expert_feed_forward_length 64"):
        ensure_view(path, tmp_path / "cache")


def test_unknown_architecture_is_refused_by_name(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match="architecture 'mamba' is not served"):
        check_gguf(path)


def test_directory_with_two_ggufs_asks_which(tmp_path):
    for n in ("a.gguf", "b.gguf"):
        (tmp_path / n).write_bytes(b"")
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        find_gguf(tmp_path)
