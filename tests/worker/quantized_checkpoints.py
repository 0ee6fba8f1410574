"""Tiny quantized checkpoints in each on-disk layout, with their dequantized float twins.

Each quantizer follows its library's packing as documented (compressed-tensors'
pack_to_int32, AutoGPTQ's and AutoAWQ's pack, bitsandbytes' quant_state), and returns
the tensors to store and the float weight the codes mean, computed from the codes
and scales before packing: the twin does not go through the loader's unpacking."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# the layers' linears by their last name part: dense, experts' (Qwen3-MoE) and the
# fused ones some checkpoints store (Phi-3); the MoE router stays float, as in
# quantized MoE checkpoints
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj")
GROUP = 32


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 holding 32 unsigned bits -> the int32 with those bits."""
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)


def pack_last(codes: torch.Tensor, order=range(8)) -> torch.Tensor:
    """4-bit codes [r, c] -> int32 [r, c / 8], nibble i holding column 8j + order[i]."""
    u = codes.to(torch.int64).view(codes.shape[0], -1, 8)
    return _to_int32(sum(u[:, :, o] << (4 * i) for i, o in enumerate(order)))


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [r, c] -> int32 [r / 8, c], nibble i holding row 8j + i (GPTQ)."""
    return pack_last(codes.T.contiguous()).T.contiguous()


def _groups(w: torch.Tensor) -> torch.Tensor:
    return w.view(w.shape[0], -1, GROUP)


def ct_int8_channel(w):
    # float32 scales: with bf16 ones compressed-tensors' decompressor rounds the products
    # to bf16, which is its twin, not the float32 one
    s = w.abs().amax(1, keepdim=True) / 127
    q = (w / s).round().clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": s}, s * q.float()


def ct_fp8_tensor(w):
    s = (w.abs().max() / 448).reshape(1)
    q = (w / s).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": s, "input_scale": torch.ones(1)}, s * q.float()


def ct_fp8_channel(w):
    s = w.abs().amax(1, keepdim=True) / 448
    q = (w / s).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": s}, s * q.float()


def ct_w4a16_group(w):
    s = _groups(w).abs().amax(-1) / 7  # [out, groups]
    q = (_groups(w) / s.unsqueeze(-1)).round().clamp(-8, 7).view_as(w)
    deq = (s.repeat_interleave(GROUP, 1) * q)
    return {"weight_packed": pack_last(q + 8), "weight_scale": s,
            "weight_shape": torch.tensor(list(w.shape))}, deq


def fp8_block(w, block=(48, 48)):
    out, inp = w.shape
    b0, b1 = block
    rows, cols = -(-out // b0), -(-inp // b1)
    s = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            s[i, j] = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].abs().max() / 448
    full = s.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:out, :inp]
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": s}, q.float() * full


def gptq(w, desc_act: bool, seed: int = 0):
    """Symmetric 4-bit, v1 checkpoint format (zeros stored as zero - 1); with desc_act
    each input column's group follows a random activation order (g_idx)."""
    out, inp = w.shape
    wt = w.T  # [in, out]
    if desc_act:
        order = torch.randperm(inp, generator=torch.Generator().manual_seed(seed))
        g = torch.empty(inp, dtype=torch.int32)
        g[order] = (torch.arange(inp) // GROUP).to(torch.int32)
    else:
        g = (torch.arange(inp) // GROUP).to(torch.int32)
    groups = inp // GROUP
    s = torch.stack([wt[g == k].abs().amax(0) / 7 for k in range(groups)]).half()  # [gr, out]
    q = (wt / s.float()[g.long()]).round().clamp(-8, 7) + 8  # [in, out] in 0..15
    zeros = torch.full((groups, out), 7)  # zero 8, stored one less
    deq = s.float()[g.long()] * (q - 8)
    stored = {"qweight": pack_rows(q), "qzeros": pack_last(zeros), "scales": s}
    if desc_act:
        stored["g_idx"] = g
    return stored, deq.T.contiguous()


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_gemm(w):
    """Asymmetric 4-bit per group of input columns, AutoAWQ's GEMM packing."""
    wt = w.T.contiguous()  # [in, out]
    g = wt.view(-1, GROUP, wt.shape[1])
    lo, hi = g.amin(1), g.amax(1)  # [groups, out]
    s = ((hi - lo) / 15).half()
    z = (-lo / s.float()).round().clamp(0, 15)
    q = ((g / s.float().unsqueeze(1)).round() + z.unsqueeze(1)).clamp(0, 15).view_as(wt)
    gi = torch.arange(wt.shape[0]) // GROUP
    deq = (q - z[gi]) * s.float()[gi]
    return ({"qweight": pack_last(q, AWQ_ORDER), "qzeros": pack_last(z, AWQ_ORDER),
             "scales": s}, deq.T.contiguous())


def bnb_int8(w):
    scb = w.abs().amax(1)
    q = (w * 127 / scb.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8)
    return {"weight": q, "SCB": scb}, q.float() * (scb.reshape(-1, 1) / 127.0)


# bitsandbytes' NF4 code values (bitsandbytes.functional.get_4bit_type("nf4"))
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def bnb_nf4(w, blocksize: int = 64, nested_blocksize: int = 256):
    """nf4 with double quantization (absmax itself 8-bit blockwise, offset by its mean)."""
    flat = w.reshape(-1)
    absmax = flat.view(-1, blocksize).abs().amax(1)
    codes = ((flat.view(-1, blocksize) / absmax.unsqueeze(1)).unsqueeze(-1) - NF4).abs() \
        .argmin(-1).reshape(-1)
    offset = absmax.mean().item()
    centered = absmax - offset
    nested_map = torch.linspace(-1, 1, 256)
    nb = torch.arange(absmax.numel()) // nested_blocksize
    nested_absmax = torch.stack([centered[nb == k].abs().max()
                                 for k in range(int(nb.max()) + 1)])
    absmax_codes = ((centered / nested_absmax[nb]).unsqueeze(-1) - nested_map).abs().argmin(-1)
    real_absmax = nested_map[absmax_codes] * nested_absmax[nb] + offset
    deq = (NF4[codes] * real_absmax[torch.arange(flat.numel()) // blocksize]).view_as(w)
    packed = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).unsqueeze(1)
    state = {"quant_type": "nf4", "blocksize": blocksize, "dtype": "float32",
             "shape": list(w.shape), "nested_blocksize": nested_blocksize,
             "nested_dtype": "float32", "nested_offset": offset}
    return ({"weight": packed, "weight.absmax": absmax_codes.to(torch.uint8),
             "weight.quant_map": NF4.clone(), "weight.nested_absmax": nested_absmax,
             "weight.nested_quant_map": nested_map,
             "weight.quant_state.bitsandbytes__nf4":
                 torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)}, deq)


def _ct(fmt, kind, bits, strategy, group=None, acts=None):
    weights = {"num_bits": bits, "type": kind, "strategy": strategy, "symmetric": True,
               "dynamic": False, "group_size": group}
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}}}


DYNAMIC_INT8_TOKENS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True,
                       "symmetric": True}
STATIC_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
              "symmetric": True}
DYNAMIC_FP8 = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
               "symmetric": True}

# name -> (quantizer, quantization_config)
LAYOUTS = {
    "ct-w8a8-int8": (ct_int8_channel, _ct("int-quantized", "int", 8, "channel",
                                          acts=DYNAMIC_INT8_TOKENS)),
    "ct-fp8-per-tensor": (ct_fp8_tensor, _ct("float-quantized", "float", 8, "tensor",
                                             acts=STATIC_FP8)),
    "ct-fp8-dynamic-per-channel": (ct_fp8_channel, _ct("float-quantized", "float", 8,
                                                       "channel", acts=DYNAMIC_FP8)),
    "ct-w4a16-pack-quantized": (ct_w4a16_group, _ct("pack-quantized", "int", 4, "group",
                                                    group=GROUP)),
    # blocks that divide the weights (what transformers' FineGrainedFP8 reads), and
    # blocks cropped at the edges (what vLLM reads too)
    "fp8-block-scale-inv": (lambda w: fp8_block(w, (32, 32)), {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [32, 32]}),
    "fp8-block-scale-inv-cropped": (fp8_block, {"quant_method": "fp8", "fmt": "e4m3",
                                                "activation_scheme": "dynamic",
                                                "weight_block_size": [48, 48]}),
    "gptq-4bit-desc-act": (lambda w: gptq(w, True), {
        "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
        "sym": True, "checkpoint_format": "gptq"}),
    "gptq-4bit": (lambda w: gptq(w, False), {
        "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
        "sym": True}),
    "awq-gemm": (awq_gemm, {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                            "version": "gemm", "zero_point": True}),
    "bnb-8bit": (bnb_int8, {"quant_method": "bitsandbytes", "load_in_8bit": True,
                            "load_in_4bit": False}),
    "bnb-nf4": (bnb_nf4, {"quant_method": "bitsandbytes", "load_in_4bit": True,
                          "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
                          "bnb_4bit_use_double_quant": True}),
}


def is_linear(name: str) -> bool:
    return ".layers." in name and name.endswith(".weight") and any(
        name.endswith(f".{n}.weight") for n in LINEARS)


def write_quantized(src: Path, quant_dir: Path, twin_dir: Path, layout: str) -> None:
    """quant_dir: src with its layers' linears quantized in `layout`; twin_dir: src
    with those linears replaced by the float32 weights the codes mean."""
    quantize, qconfig = LAYOUTS[layout]
    tensors = load_file(str(src / "model.safetensors"))
    stored, twin = {}, {}
    for name, t in tensors.items():
        if not is_linear(name):
            stored[name] = twin[name] = t
            continue
        parts, deq = quantize(t.float())
        prefix = name.removesuffix(".weight")
        stored |= {f"{prefix}.{k}": v.contiguous() for k, v in parts.items()}
        twin[name] = deq.float().contiguous()
    for out, content in ((quant_dir, stored), (twin_dir, twin)):
        shutil.copytree(src, out)
        save_file(content, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qconfig
    (quant_dir / "config.json").write_text(json.dumps(config))
