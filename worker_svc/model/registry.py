"""Which family module serves a checkpoint, keyed by its config's `architectures`
(and by `model_type` where a config has no architectures), as vLLM's
model_executor/models/registry.py.

Adding a family is one module under worker_svc/model/ and one row in each table
below. The module defines, in this order of use:

- `configure(hf, cfg) -> ModelConfig`: reads the family's own config fields (its
  typed fields on ModelConfig: qkv_bias, qk_norm, moe, ...) from the transformers
  config `hf` into `cfg` (already holding the shared ones: sizes, heads, RoPE, EOS)
  and raises ValueError naming what it cannot run (a field, a value, an option).
- `load_weights(model_dir, cfg, dtype, device, shard, matmul_dtype, slices) -> weights`:
  this rank's slice of the checkpoint (worker_svc/parallel/shard.py), read through
  `slices` (weights.CheckpointSlices; gguf_quantized.QuantizedSlices keeps a GGUF's
  matmul weights as its blocks, the quantized path). The checkpoint-name -> fused-weight table is a module
  constant beside it (`PACKED_MODULES_MAPPING`, as nano-vllm's: which tensors stack
  into which fused matmul, e.g. qkv <- q_proj, k_proj, v_proj).
- `Model(cfg, weights, backend, max_positions, plan, tp)`: `forward(input_ids,
  positions, kv_caches, meta, logits_indices, argmax_only)`, `allocate_kv_caches`,
  `dtype` and `screen_rows`. A torch family subclasses torch_decoder.TorchDecoder
  and overrides `attention`, `mlp` or the whole `layer`, from layers.py's pieces.

`Family.c_kernels` says whether the fast path's C kernels (fused element-wise ops,
the one-call layer loop, the small-batch matmul and its int8 copies) can run the
family: only llama.py's DecoderModel (Llama, Mistral, Qwen2) takes them; every other
family runs the torch path, and the compute plan refuses the C-only options for it.
`Family.quant_c_loop` names the model types whose decode steps on a GGUF's blocks run
a one-call C layer loop of their own (Gemma 3: decode_layers.GemmaDecodeLayers).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # the module under worker_svc/model/
    c_kernels: bool  # llama.py's fast path with the C kernels (compute_plan.py)
    # model types whose decode steps on a GGUF's blocks run the family's own one-call
    # C layer loop (model/cpu/decode_layers.py; compute_plan.py)
    quant_c_loop: tuple[str, ...] = ()

    def module(self):
        return importlib.import_module(f"worker_svc.model.{self.name}")


LLAMA = Family("llama", c_kernels=True)
QWEN3 = Family("qwen3", c_kernels=False)
QWEN3_MOE = Family("qwen3_moe", c_kernels=False)
QWEN2_MOE = Family("qwen2_moe", c_kernels=False)
MIXTRAL = Family("mixtral", c_kernels=False)
GEMMA = Family("gemma", c_kernels=False, quant_c_loop=("gemma3_text",))
PHI3 = Family("phi3", c_kernels=False)

# config.json's "architectures" entry -> the family that serves it
ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "Qwen3ForCausalLM": QWEN3,
    "Qwen3MoeForCausalLM": QWEN3_MOE,
    "Qwen2MoeForCausalLM": QWEN2_MOE,
    "MixtralForCausalLM": MIXTRAL,
    "Gemma2ForCausalLM": GEMMA,
    "Gemma3ForCausalLM": GEMMA,
    "Gemma3ForConditionalGeneration": GEMMA,  # its text model (config.py, weights.py)
    "Phi3ForCausalLM": PHI3,
}

# "model_type" -> family, for configs without architectures; also the model types a
# family's module accepts (an architecture name alone never picks a different type)
MODEL_TYPES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3_MOE,
    "qwen2_moe": QWEN2_MOE,
    "mixtral": MIXTRAL,
    "gemma2": GEMMA,
    "gemma3_text": GEMMA,
    "gemma3": GEMMA,
    "phi3": PHI3,
}


FAMILIES: dict[str, Family] = {f.name: f for f in MODEL_TYPES.values()}


def family_of(hf) -> Family:
    """The family serving a transformers config; ValueError naming the unknown
    architecture or model_type and what is supported."""
    model_type = getattr(hf, "model_type", None)
    by_type = MODEL_TYPES.get(model_type)
    if by_type is None:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         f"{', '.join(MODEL_TYPES)}")
    archs = list(getattr(hf, "architectures", None) or [])
    if not archs:
        return by_type
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise ValueError(f"unsupported architecture {', '.join(map(repr, archs))} "
                         f"(model_type {model_type!r}); supported: "
                         f"{', '.join(ARCHITECTURES)}")
    family = ARCHITECTURES[known[0]]
    if family is not by_type:
        raise ValueError(f"architecture {known[0]!r} does not match model_type "
                         f"{model_type!r}")
    return family
