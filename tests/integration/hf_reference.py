"""The transformers reference that greedy outputs are compared against."""

from pathlib import Path

import torch

from shared.model_files.gguf_model import gguf_source


def load_reference(model_dir):
    """transformers' float32 model of a checkpoint directory, or of the GGUF a view
    directory serves (the default model's: `gguf_file=`, dequantized as we do)."""
    from transformers import AutoModelForCausalLM
    source = gguf_source(Path(model_dir))
    if source is None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy choice for n steps, EOS included (as with ignore_eos):
    a plain argmax loop, since generate() would suppress EOS under min_new_tokens."""
    ids, out, cache = torch.tensor([prompt]), [], None
    with torch.no_grad():
        for _ in range(n):
            step = model(ids if cache is None else ids[:, -1:], cache=cache, use_cache=True)
            cache = step.cache
            out.append(int(step.logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out
