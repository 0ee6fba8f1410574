"""Weights are read from safetensors straight into their final tensors: bit-equal to
safetensors' own load (fused where the model fuses, converted where the dtype
differs), each held once, no file mapping left behind, clear errors for bad files."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker_svc.model.config import load_model_config
from worker_svc.model.loading.safetensors_io import (CheckpointError, TensorReader, new_tensor,
                                             read_header)
from worker_svc.model.loading.weights import checkpoint_files, load_weights


def _load(model_dir, dtype=torch.float32):
    return load_weights(Path(model_dir), load_model_config(Path(model_dir)), dtype,
                        torch.device("cpu"))


def _safetensors_load(model_dir):
    tensors = {}
    for path in checkpoint_files(Path(model_dir)):
        tensors.update(load_file(str(path)))
    return tensors


def _assert_equal(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want.to(dtype))


def _assert_matches(weights, ref, dtype):
    def cat(*names):
        return torch.cat([ref[n] for n in names])

    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        _assert_equal(lw.input_norm, ref[p + "input_layernorm.weight"], dtype)
        _assert_equal(lw.qkv, cat(a + "q_proj.weight", a + "k_proj.weight",
                                  a + "v_proj.weight"), dtype)
        _assert_equal(lw.o_proj, ref[a + "o_proj.weight"], dtype)
        _assert_equal(lw.post_norm, ref[p + "post_attention_layernorm.weight"], dtype)
        _assert_equal(lw.gate_up, cat(m + "gate_proj.weight", m + "up_proj.weight"), dtype)
        _assert_equal(lw.down, ref[m + "down_proj.weight"], dtype)
        if a + "q_proj.bias" in ref:
            _assert_equal(lw.qkv_bias, cat(a + "q_proj.bias", a + "k_proj.bias",
                                           a + "v_proj.bias"), dtype)
        else:
            assert lw.qkv_bias is None
    _assert_equal(weights.embed, ref["model.embed_tokens.weight"], dtype)
    _assert_equal(weights.final_norm, ref["model.norm.weight"], dtype)
    _assert_equal(weights.lm_head, ref.get("lm_head.weight", ref["model.embed_tokens.weight"]),
                  dtype)


@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen2_dir",
                                        "tiny_mistral_sharded_dir"])
def test_loaded_weights_equal_safetensors_own_load_bit_for_bit(checkpoint, request):
    model_dir = request.getfixturevalue(checkpoint)
    _assert_matches(_load(model_dir), _safetensors_load(model_dir), torch.float32)


def test_sharded_checkpoint_reads_every_shard_named_by_its_index(tiny_mistral_sharded_dir):
    index = json.loads((tiny_mistral_sharded_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1  # the fixture really is sharded
    assert {p.name for p in checkpoint_files(tiny_mistral_sharded_dir)} == shards


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16])
def test_tensor_over_a_mebibyte_in_its_own_mapping_reads_bit_equal(tmp_path, file_dtype):
    big = torch.randn(700, 1024, generator=torch.Generator().manual_seed(0)).to(file_dtype)
    path = tmp_path / "big.safetensors"
    save_file({"small": torch.arange(5.0), "big": big}, str(path))
    entry = read_header(path)["big"]
    out = new_tensor(entry.shape, torch.float32, torch.device("cpu"))
    with TensorReader() as reader:
        reader.read_into(entry, out)
    assert torch.equal(out, big.float())


def _copy_checkpoint(src, dst, convert=None, extra=None):
    """src's config and weights in dst, tensors converted and extended as asked."""
    dst.mkdir(exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = _safetensors_load(src)
    if convert is not None:
        tensors = {k: v.to(convert) for k, v in tensors.items()}
    tensors.update(extra or {})
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_bfloat16_file_loads_as_float32_exactly(tiny_qwen2_dir, tmp_path):
    model_dir = _copy_checkpoint(tiny_qwen2_dir, tmp_path / "bf16", convert=torch.bfloat16)
    _assert_matches(_load(model_dir), _safetensors_load(model_dir), torch.float32)


def test_float32_file_loads_as_bfloat16_like_torch_rounds_it(tiny_qwen2_dir):
    _assert_matches(_load(tiny_qwen2_dir, torch.bfloat16), _safetensors_load(tiny_qwen2_dir),
                    torch.bfloat16)


def test_tied_head_is_the_embedding_itself_even_when_the_file_stores_a_copy(
        tiny_llama_dir, tmp_path):
    embed = _safetensors_load(tiny_llama_dir)["model.embed_tokens.weight"]
    model_dir = _copy_checkpoint(tiny_llama_dir, tmp_path / "tied",
                                 extra={"lm_head.weight": torch.zeros_like(embed)})
    weights = _load(model_dir)
    assert weights.lm_head is weights.embed
    assert torch.equal(weights.embed, embed)


def _all_tensors(weights):
    layer_tensors = [getattr(lw, f) for lw in weights.layers for f in lw.__slots__]
    tensors = layer_tensors + [weights.embed, weights.final_norm, weights.lm_head]
    return {id(t): t for t in tensors if t is not None}.values()  # tied head counted once


def test_each_weight_is_held_once_in_storage_of_exactly_its_size(tiny_qwen2_dir):
    tensors = _all_tensors(_load(tiny_qwen2_dir))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert sum(storages.values()) == sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_loading_leaves_no_mapping_of_the_checkpoint_file(tiny_mistral_sharded_dir, tmp_path):
    model_dir = tmp_path / "fresh"  # a copy nothing else in this session has mapped
    shutil.copytree(tiny_mistral_sharded_dir, model_dir)
    weights = _load(model_dir)
    maps = Path("/proc/self/maps").read_text()
    assert all(str(path) not in maps for path in checkpoint_files(model_dir))
    assert weights.embed.numel() > 0


def _header(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path, header, data):
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


@pytest.fixture
def damaged_copy(tiny_llama_dir, tmp_path):
    """A copy of tiny_llama_dir whose model.safetensors the test then damages."""
    dst = tmp_path / "damaged"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def _last_tensor(header):
    return max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])


def test_truncated_file_is_refused_naming_file_and_tensor(damaged_copy):
    path = damaged_copy / "model.safetensors"
    header, data = _header(path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as err:
        _load(damaged_copy)
    message = str(err.value)
    assert str(path) in message and _last_tensor(header) in message and "truncated" in message


def test_file_cut_inside_its_header_is_refused(damaged_copy):
    path = damaged_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="header length"):
        _load(damaged_copy)


def test_out_of_range_offsets_are_refused_naming_the_tensor(damaged_copy):
    path = damaged_copy / "model.safetensors"
    header, data = _header(path)
    name = "model.layers.1.mlp.down_proj.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [len(data) + 64, len(data) + 64 + end - begin]
    _write(path, header, data)
    with pytest.raises(CheckpointError, match=f"{name} has data_offsets .* outside"):
        _load(damaged_copy)


def test_size_not_matching_shape_and_dtype_is_refused(damaged_copy):
    path = damaged_copy / "model.safetensors"
    header, data = _header(path)
    name = "model.layers.0.self_attn.q_proj.weight"
    header[name]["shape"][0] += 1
    _write(path, header, data)
    with pytest.raises(CheckpointError, match=f"{name} has .* bytes but shape"):
        _load(damaged_copy)


def test_missing_tensor_is_named(damaged_copy):
    path = damaged_copy / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="lacks tensor model.layers.2.self_attn.k_proj.weight"):
        _load(damaged_copy)
