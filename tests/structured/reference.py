"""transformers' greedy output with a grammar applied as a logits processor: the
reference constrained outputs are compared against. The processor uses the same
backend (llguidance) and grammar text, but its own matcher, advanced on the tokens
transformers chose."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from shared.structured import compile_cache as so
from shared.structured.backend import GrammarVocab
from shared.structured.spec import StructuredOutputSpec


class GrammarLogitsProcessor(LogitsProcessor):
    """Sets the logits of the tokens the grammar forbids to -inf; it advances its
    matcher on the last token of input_ids from the second call on."""

    def __init__(self, spec: StructuredOutputSpec, vocab: GrammarVocab) -> None:
        self.matcher = so.compile_spec(spec, vocab).new_matcher()
        self.started = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.started:
            assert self.matcher.accept(int(input_ids[0, -1])), self.matcher.error()
        self.started = True
        vocab = scores.shape[-1]
        words = (vocab + 31) // 32
        bitmask = torch.zeros(words, dtype=torch.int32)
        self.matcher.fill_bitmask(bitmask.data_ptr(), words * 4)
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.bool().flatten()[:vocab]
        return scores.masked_fill(~allowed, float("-inf"))


def hf_constrained_greedy(model, prompt: list[int], n: int, processor: LogitsProcessor,
                          eos_ids: set[int]) -> list[int]:
    """Greedy for up to n tokens through the processor, ending after an EOS (the
    grammar's end), EOS included."""
    ids, out, cache = torch.tensor([prompt]), [], None
    with torch.no_grad():
        for _ in range(n):
            step = model(ids if cache is None else ids[:, -1:], cache=cache, use_cache=True)
            cache = step.cache
            scores = processor(ids, step.logits[:, -1].float())
            out.append(int(scores[0].argmax()))
            if out[-1] in eos_ids:
                break
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out
