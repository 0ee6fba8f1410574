"""Which decoder forward serves a ModelConfig.family (model/config.py decides the family
from the checkpoint's model_type)."""

from __future__ import annotations


def decoder_class(cfg):
    if cfg.family == "gemma":
        from worker_svc.model.gemma import GemmaModel
        return GemmaModel
    from worker_svc.model.llama import DecoderModel
    return DecoderModel
