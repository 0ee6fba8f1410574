"""Tiny checkpoints for speculative decoding: a 3-layer Llama with a 256-token vocabulary
(small enough that its greedy text repeats, so prompt lookup finds drafts), and a draft
model made from it: its first layer alone, the same embedding and tokenizer (a
LayerSkip-style draft that agrees with the target often, but not always)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.speculative_config import parse_speculative_config

NGRAM = '{"method": "ngram", "num_speculative_tokens": %d, "prompt_lookup_min": 1, ' \
    '"prompt_lookup_max": 3}'
SELF_DRAFT = '{"method": "draft_model", "quantization": "int8", "num_speculative_tokens": %d}'
DRAFT_MODEL = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": %d}'
METHODS = ("ngram", "int8_self_draft", "draft_model")


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.worker.conftest import _write_checkpoint
    return _write_checkpoint(tmp_path_factory.mktemp("spec_target"), LlamaConfig,
                             LlamaForCausalLM, tie_word_embeddings=True, rope_theta=10000.0)


@pytest.fixture(scope="session")
def draft_dir(target_dir, tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    out = tmp_path_factory.mktemp("spec_draft")
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def hf_target(target_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32).eval()


def spec_json(method: str, k: int, draft_dir: Path | None = None,
              disable_by_batch_size: int | None = None) -> str:
    text = NGRAM % k if method == "ngram" else SELF_DRAFT % k \
        if method == "int8_self_draft" else DRAFT_MODEL % (draft_dir, k)
    if disable_by_batch_size is not None:
        text = text[:-1] + f', "disable_by_batch_size": {disable_by_batch_size}}}'
    return text


def make_runner(model_dir: Path, spec: str | None = None, **config):
    from worker_svc.config import WorkerConfig
    from worker_svc.runner import ModelRunner
    config.setdefault("num_gpu_blocks_override", 96)
    return ModelRunner(WorkerConfig(model=str(model_dir), device="cpu", max_model_len=256,
                                    max_num_seqs=8, speculative_config=
                                    parse_speculative_config(spec), **config))
