"""The registry picks each checkpoint's family module by its architectures (or its
model_type without them), and whatever no family serves is refused with a message
naming it: an unknown model_type or architecture, a rope type, a layer option, and
the C-only options for a family on the torch layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from worker_svc.compute_plan import build_plan
from worker_svc.config import WorkerConfig
from worker_svc.model.config import load_model_config
from worker_svc.model.registry import ARCHITECTURES, MODEL_TYPES, family_of

CPU = torch.device("cpu")


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of a checkpoint's config.json (weights are not read) with changes."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("name,family", [("qwen3", "qwen3"), ("qwen3_moe", "qwen3_moe"),
                                         ("mixtral", "mixtral"), ("qwen2_yarn", "llama")])
def test_each_architecture_is_served_by_its_family_module(family_dir, name, family):
    cfg = load_model_config(family_dir(name))
    assert cfg.family == family
    assert family_of(cfg.hf_config).module().Model is not None


def test_every_registered_architecture_and_model_type_names_an_importable_module():
    for fam in {*ARCHITECTURES.values(), *MODEL_TYPES.values()}:
        module = fam.module()
        for name in ("configure", "load_weights", "Model"):
            assert hasattr(module, name), (fam.name, name)


def test_a_config_without_architectures_is_picked_by_model_type(family_dir, tmp_path):
    path = _edit_config(family_dir("qwen3"), tmp_path / "c", architectures=None)
    assert load_model_config(path).family == "qwen3"


def test_an_unknown_model_type_is_refused_naming_it_and_the_supported_ones(family_dir,
                                                                           tmp_path):
    path = _edit_config(family_dir("qwen3"), tmp_path / "c", model_type="gpt_neox",
                        architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt_neox'; supported: "
                                         r"llama, .*qwen3, qwen3_moe, qwen2_moe, mixtral"):
        load_model_config(path)


def test_an_unknown_architecture_of_a_known_model_type_is_refused_naming_it(family_dir,
                                                                             tmp_path):
    path = _edit_config(family_dir("qwen3"), tmp_path / "c",
                        architectures=["Qwen3ForSequenceClassification"])
    with pytest.raises(ValueError, match="unsupported architecture "
                                         "'Qwen3ForSequenceClassification'"):
        load_model_config(path)


def test_an_unsupported_rope_type_is_refused_naming_it(family_dir, tmp_path):
    path = _edit_config(family_dir("qwen3"), tmp_path / "c", rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        load_model_config(path)


def test_qwen3_sliding_layers_follow_transformers_max_window_layers_and_layer_types(
        family_dir, tmp_path):
    from worker_svc.model.config import layer_windows
    qwen3 = load_model_config(family_dir("qwen3_sliding_layers"))
    assert layer_windows(qwen3, 256) == [None, 24, 24]  # max_window_layers 1
    moe = load_model_config(family_dir("qwen3_moe_sliding_window"))
    assert layer_windows(moe, 256) == [24, 24, 24]  # every layer, as transformers
    # without use_sliding_window transformers drops the window: every key is seen
    off = load_model_config(_edit_config(family_dir("qwen3"), tmp_path / "c",
                                         sliding_window=24, max_window_layers=1))
    assert layer_windows(off, 256) == [None, None, None]


def test_moe_configs_give_the_router_rule_and_sparse_layers_of_their_family(family_dir):
    mixtral = load_model_config(family_dir("mixtral"))
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.renormalize) == (4, 2, True)
    assert mixtral.moe_layers == (True, True, True)
    qwen = load_model_config(family_dir("qwen3_moe_unnormalized_sparse_step"))
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.renormalize) == (5, 3, False)
    assert qwen.moe_layers == (False, True, False)  # decoder_sparse_step 2
    assert qwen.qk_norm and mixtral.qk_norm is False


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral"])
def test_torch_families_take_no_c_layer_kernels_and_the_plan_says_so(family_dir, name):
    cfg = load_model_config(family_dir(name))
    plan = build_plan(WorkerConfig(), CPU, cfg, biases=False)
    assert (plan.fused_ops, plan.decode_layers, plan.small_batch, plan.prepack,
            plan.argmax_screen) == (False, False, "off", False, False)
    assert {f"family={name}", "layers=torch"} <= set(plan.summary().split())


def test_the_llama_family_keeps_its_c_layers(family_dir):
    cfg = load_model_config(family_dir("qwen2_yarn"))
    plan = build_plan(WorkerConfig(), CPU, cfg, biases=True)
    assert {"family=llama", "layers=c"} <= set(plan.summary().split())


def test_int8_quantization_is_refused_for_a_torch_family_naming_the_option(family_dir):
    cfg = load_model_config(family_dir("qwen3"))
    with pytest.raises(ValueError, match="--quantization int8 .* family 'qwen3'"):
        build_plan(WorkerConfig(quantization="int8"), CPU, cfg, biases=False)


def _runner(path, **kw):
    from worker_svc.runner import ModelRunner
    return ModelRunner(WorkerConfig(model=str(path), device="cpu", max_model_len=128,
                                    num_gpu_blocks_override=16, max_num_seqs=2, **kw))


def test_dummy_weights_are_refused_for_a_torch_family(family_dir):
    with pytest.raises(ValueError, match="--load-format dummy .* family 'mixtral'"):
        _runner(family_dir("mixtral"), load_format="dummy")


@pytest.mark.parametrize("spec", [
    '{"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 2}'])
def test_draft_speculation_is_refused_for_a_torch_family_ngram_is_served(family_dir, spec):
    from shared.speculative_config import parse_speculative_config
    with pytest.raises(ValueError, match="family 'qwen3' speculates with ngram only"):
        _runner(family_dir("qwen3"), speculative_config=parse_speculative_config(spec))


def test_yarn_serves_its_scaled_context_past_max_position_embeddings(family_dir):
    """Qwen2.5's recipe: max_position_embeddings 64, YaRN x4 over the original 64."""
    from worker_svc.runner import _resolve_max_model_len
    cfg = load_model_config(family_dir("qwen2_yarn"))
    assert (cfg.max_position_embeddings, cfg.max_context) == (64, 256)
    assert _resolve_max_model_len(None, cfg) == 256
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 256\]"):
        _resolve_max_model_len(257, cfg)


def test_without_yarn_the_context_stays_max_position_embeddings(family_dir):
    cfg = load_model_config(family_dir("qwen3"))
    assert cfg.max_context == cfg.max_position_embeddings


def test_qwen2_sliding_window_is_refused_by_name(family_dir, tmp_path):
    path = _edit_config(family_dir("qwen2_yarn"), tmp_path / "c", use_sliding_window=True,
                        sliding_window=32)
    with pytest.raises(ValueError, match="Qwen2 sliding-window attention"):
        load_model_config(path)


def test_an_activation_other_than_silu_is_refused_by_name(family_dir, tmp_path):
    path = _edit_config(family_dir("mixtral"), tmp_path / "c", hidden_act="gelu")
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        load_model_config(path)


def test_a_mixtral_sliding_window_no_longer_caps_max_model_len_it_applies_past_it(
        family_dir, tmp_path):
    """Served past the window: its layers attend within it (config.layer_windows)."""
    from worker_svc.model.config import layer_windows
    from worker_svc.runner import _resolve_max_model_len
    path = _edit_config(family_dir("mixtral"), tmp_path / "c", sliding_window=48)
    cfg = load_model_config(path)
    assert cfg.sliding_window == 48
    assert _resolve_max_model_len(None, cfg) == cfg.max_position_embeddings > 48
    assert layer_windows(cfg, 512) == [48] * cfg.num_layers
    assert layer_windows(cfg, 48) == [None] * cfg.num_layers  # hides nothing: full kernels
