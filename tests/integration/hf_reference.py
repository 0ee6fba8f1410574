"""The transformers reference that greedy outputs are compared against."""

import torch


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
