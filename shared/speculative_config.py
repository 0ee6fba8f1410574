"""`--speculative-config JSON`: vLLM's interface to speculative decoding, parsed and
checked once, at start-up (docs/spec_decode.md).

Three shapes are served:

    {"method": "ngram", "num_speculative_tokens": k,
     "prompt_lookup_min": a, "prompt_lookup_max": b}          prompt lookup, no second model
    {"method": "draft_model", "model": DIR, "num_speculative_tokens": k}
                                                              a smaller local checkpoint
    {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": k}
                                                              the served model's own int8 copy

plus `"disable_by_batch_size": n` on any of them (no drafts in a step while n or more
requests are enqueued, running or waiting, vLLM's rule). vLLM's own defaults and
checks are kept where it has them (prompt_lookup_min/max default to 5, one given
sets the other, min <= max, disable_by_batch_size >= 2, `"model": "ngram"` means the
ngram method); anything we do not serve (other methods, other keys) is refused by
name, never ignored: a key that is silently dropped would change what the operator
thinks runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
# Acceptance decays about geometrically with the draft position, so slots beyond this
# almost never commit a token, while each costs a verify position and a KV slot.
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both prompt_lookup_min and _max
QUANTIZATIONS = ("int8",)
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
        "model", "quantization", "disable_by_batch_size")
NOT_SERVED = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix", "ngram_gpu",
              "deepseek_mtp", "custom_class")


class SpeculativeConfigError(ValueError):
    """A --speculative-config that cannot be served; the message names the field."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # one of METHODS
    num_speculative_tokens: int  # k: the most draft slots a request gets in one step
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0  # ngram only
    model: str | None = None  # draft_model: a local checkpoint directory
    quantization: str | None = None  # draft_model without a model: "int8" (self-draft)
    disable_by_batch_size: int | None = None  # no drafts while this many requests run

    @property
    def is_int8_self_draft(self) -> bool:
        """The draft is the served model's own int8 copy (no second checkpoint)."""
        return self.method == "draft_model" and self.model is None

    def to_json(self) -> str:
        """Canonical JSON (what ModelInfo carries; parse_speculative_config reads it
        back to an equal config): only the keys set, in a fixed order."""
        value = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            value.update(prompt_lookup_min=self.prompt_lookup_min,
                         prompt_lookup_max=self.prompt_lookup_max)
        for key in ("model", "quantization", "disable_by_batch_size"):
            if getattr(self, key) is not None:
                value[key] = getattr(self, key)
        return json.dumps(value, separators=(",", ":"))

    def speculates(self, num_enqueued: int) -> bool:
        """vLLM's disable_by_batch_size: does a step get draft slots while this many
        requests are enqueued (running plus waiting, as vLLM's docs count them)? Above
        the size the verify pass's extra positions cost more than the accepted tokens
        save (the batch is compute-bound, not bandwidth-bound), and while a burst is
        still being admitted its prompts need the budget more than guesses do."""
        limit = self.disable_by_batch_size
        return limit is None or num_enqueued < limit


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """The flag's JSON text (or an already decoded dict) -> SpeculativeConfig; None or
    an empty string means speculation off. Raises SpeculativeConfigError."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise SpeculativeConfigError(
            f"--speculative-config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise SpeculativeConfigError(
            f"--speculative-config has unsupported key(s) {', '.join(unknown)}; "
            f"supported: {', '.join(KEYS)}")
    method = _method(value)
    k = _int(value, "num_speculative_tokens", required=True, low=1,
             high=MAX_SPECULATIVE_TOKENS)
    limit = _int(value, "disable_by_batch_size", low=2)
    if method == "ngram":
        return _ngram(value, k, limit)
    return _draft_model(value, k, limit)


def _method(value: dict) -> str:
    method = value.get("method")
    model = value.get("model")
    if method is None:  # vLLM infers it: "ngram" as the model, else a draft model
        if model in ("ngram", "[ngram]"):
            return "ngram"
        if model is None and value.get("quantization") is None:
            raise SpeculativeConfigError(
                "--speculative-config needs a method: \"ngram\" or \"draft_model\"")
        return "draft_model"
    if not isinstance(method, str):
        raise SpeculativeConfigError(f"method must be a string, got {method!r}")
    if method == "[ngram]":
        return "ngram"
    if method in METHODS:
        return method
    served = ", ".join(METHODS)
    if method in NOT_SERVED:
        raise SpeculativeConfigError(f"method {method!r} is not served by gapserve; "
                                     f"supported: {served}")
    raise SpeculativeConfigError(f"unknown method {method!r}; supported: {served}")


def _int(value: dict, name: str, *, required: bool = False, low: int = 1,
         high: int | None = None) -> int | None:
    v = value.get(name)
    if v is None:
        if required:
            raise SpeculativeConfigError(f"{name} is required")
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise SpeculativeConfigError(f"{name} must be an integer, got {v!r}")
    if v < low or (high is not None and v > high):
        bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
        raise SpeculativeConfigError(f"{name} must be {bound}, got {v}")
    return v


def _ngram(value: dict, k: int, limit: int | None) -> SpeculativeConfig:
    model = value.get("model")
    if model not in (None, "ngram", "[ngram]"):
        raise SpeculativeConfigError(
            f"method \"ngram\" takes no model (prompt lookup needs none), got {model!r}")
    if value.get("quantization") is not None:
        raise SpeculativeConfigError("method \"ngram\" takes no quantization")
    lo = _int(value, "prompt_lookup_min")
    hi = _int(value, "prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if lo > hi:
        raise SpeculativeConfigError(
            f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    return SpeculativeConfig("ngram", k, lo, hi, disable_by_batch_size=limit)


def _draft_model(value: dict, k: int, limit: int | None) -> SpeculativeConfig:
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if value.get(name) is not None:
            raise SpeculativeConfigError(f"{name} belongs to method \"ngram\", not "
                                         f"\"draft_model\"")
    model = value.get("model")
    quant = value.get("quantization")
    if quant is not None and quant not in QUANTIZATIONS:
        raise SpeculativeConfigError(
            f"quantization {quant!r} is not served; supported: {', '.join(QUANTIZATIONS)} "
            f"(the served model's own int8 copy)")
    if model is None:
        if quant is None:
            raise SpeculativeConfigError(
                "method \"draft_model\" needs a model (a local checkpoint directory) or "
                "\"quantization\": \"int8\" for the served model's own int8 copy")
        return SpeculativeConfig("draft_model", k, quantization=quant,
                                 disable_by_batch_size=limit)
    if quant is not None:
        raise SpeculativeConfigError(
            "quantization \"int8\" names the int8 self-draft and takes no model: the "
            "draft model runs as stored")
    if not isinstance(model, str) or not model:
        raise SpeculativeConfigError(f"model must be a directory path, got {model!r}")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise SpeculativeConfigError(  # nothing is ever fetched from a model hub
            f"draft model {model!r} is not a local checkpoint directory (no config.json)")
    return SpeculativeConfig("draft_model", k, model=model, disable_by_batch_size=limit)


def speculative_config_arg(text: str) -> SpeculativeConfig | None:
    """argparse type of --speculative-config: the error names the field at fault."""
    import argparse
    try:
        return parse_speculative_config(text)
    except SpeculativeConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def spec_decode_summary(status) -> dict:
    """What /v1/status and `gapserve status` show of speculative decoding, from an
    EngineStatus (or anything with its spec_* fields): vLLM's acceptance rate
    (accepted / proposed drafts), the mean tokens a draft step commits (1 + accepted /
    drafts) and the acceptance by draft position."""
    drafts, proposed = status.spec_num_drafts, status.spec_num_draft_tokens
    accepted = status.spec_num_accepted_tokens
    return {"config": status.speculative_config, "num_drafts": drafts,
            "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate_per_position": [n / drafts for n in
                                             status.spec_num_accepted_tokens_per_pos]
            if drafts else []}
