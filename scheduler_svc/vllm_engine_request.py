"""`vllm.grpc.engine` GenerateRequest -> our Request, and our outputs -> its replies:
the translation half of the VllmEngine servicer (scheduler_svc/vllm_engine.py).

The protocol's defaults are vLLM's (proto3 zeros mean "unset": top_p 0 is 1.0,
repetition_penalty 0 is 1.0, an unset max_tokens is what is left of max_model_len).
What we cannot honour is refused with InvalidRequestError naming the field, never
dropped: text prompts (the gateway tokenizes), n > 1, prompt logprobs, multimodal and
disaggregation fields. Stop strings (`stop`, `include_stop_str_in_output`) are the
gateway's, as they are our own frontend's: the scheduler sees token ids only, and
smg's stop-sequence decoder matches them on the text it detokenizes, trims the
output and cancels the stream (which aborts the request here).
"""

from __future__ import annotations

import json
import time

from google.protobuf import unknown_fields
from smg_grpc_proto import vllm_engine_pb2 as pb

from scheduler_svc.core.request import Request
from shared.structured.spec import StructuredOutputSpec
from shared.types import FinishReason, InvalidRequestError, RequestOutput, SamplingParams, \
    TokenLogprobs

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "abort"}
# GenerateRequest fields we refuse when set (unset or empty is fine)
_REFUSED_REQUEST_FIELDS = {
    "text": "send tokenized.input_ids: gapserve's scheduler does not tokenize",
    "kv_transfer_params": "prefill/decode disaggregation is not supported (docs/scale_out.md)",
    "kv_transfer_params_json": "prefill/decode disaggregation is not supported "
                               "(docs/scale_out.md)",
    "mm_inputs": "multimodal inputs are not supported: gapserve serves text models",
    "media_refs": "multimodal inputs are not supported: gapserve serves text models",
}
# SamplingParams fields we refuse when set
_REFUSED_SAMPLING_FIELDS = {
    "prompt_logprobs": "prompt logprobs are not supported",
    "truncate_prompt_tokens": "prompt truncation is not supported: send a prompt that fits",
    "structural_tag": "structural_tag constraints are not supported; use json_schema, "
                      "regex, grammar, json_object or choice",
}


def unknown_field_numbers(msg) -> list[int]:
    """Field numbers a newer client sent that this protocol version does not know,
    in `msg` or any message inside it."""
    found = [f.field_number for f in unknown_fields.UnknownFieldSet(msg)]
    for desc, value in msg.ListFields():
        if desc.message_type is None:
            continue
        if desc.is_repeated:
            items = value.values() if desc.message_type.GetOptions().map_entry else value
            items = [v for v in items if hasattr(v, "ListFields")]
        else:
            items = [value]
        for item in items:
            found += unknown_field_numbers(item)
    return found


def request_from_proto(msg: pb.GenerateRequest, eos_token_ids: list[int],
                       max_model_len: int) -> Request:
    """The Request for a Generate call; InvalidRequestError names what is refused."""
    unknown = unknown_field_numbers(msg)
    if unknown:
        raise InvalidRequestError(
            f"unknown field number(s) {sorted(set(unknown))} in GenerateRequest: this "
            "server speaks vllm.grpc.engine from smg-grpc-proto 0.4.28")
    for name, why in _REFUSED_REQUEST_FIELDS.items():
        if msg.HasField(name):
            raise InvalidRequestError(f"GenerateRequest.{name} is not supported: {why}")
    if msg.extra_mm_inputs:
        raise InvalidRequestError("GenerateRequest.extra_mm_inputs is not supported: "
                                  "gapserve serves text models")
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != 0:
        raise InvalidRequestError(
            f"GenerateRequest.data_parallel_rank {msg.data_parallel_rank} does not exist: "
            "each gapserve scheduler is one data-parallel rank (rank 0); the gateway "
            "routes between replicas")
    if not msg.HasField("tokenized"):
        raise InvalidRequestError("GenerateRequest has no input: send tokenized.input_ids")
    prompt = list(msg.tokenized.input_ids)
    params = sampling_from_proto(msg.sampling_params, len(prompt), max_model_len)
    return Request(msg.request_id, prompt, params, eos_token_ids, arrival_time=time.time())


def sampling_from_proto(sp: pb.SamplingParams, num_prompt_tokens: int,
                        max_model_len: int) -> SamplingParams:
    for name, why in _REFUSED_SAMPLING_FIELDS.items():
        if sp.HasField(name):
            raise InvalidRequestError(f"SamplingParams.{name} is not supported: {why}")
    if sp.n > 1:
        raise InvalidRequestError(f"SamplingParams.n = {sp.n} is not supported: send n "
                                  "requests (gapserve generates one sequence per request)")
    if sp.HasField("logprobs") and sp.logprobs < 0:
        raise InvalidRequestError(f"SamplingParams.logprobs = {sp.logprobs} (all) is not "
                                  f"supported: at most {SamplingParams.MAX_LOGPROBS}")
    params = SamplingParams(
        # vLLM's defaults for the proto3 zeros that mean "unset"
        max_tokens=sp.max_tokens if sp.HasField("max_tokens")
        else max(max_model_len - num_prompt_tokens, 1),
        temperature=sp.temperature if sp.HasField("temperature") else 1.0,
        top_p=sp.top_p or 1.0, top_k=sp.top_k, min_p=sp.min_p,
        seed=sp.seed if sp.HasField("seed") else None,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty or 1.0, min_tokens=sp.min_tokens,
        stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,
        logit_bias={int(k): float(v) for k, v in sp.logit_bias.items()},
        structured_output=_constraint(sp))
    return params


def _constraint(sp: pb.SamplingParams) -> StructuredOutputSpec | None:
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        return StructuredOutputSpec("json", sp.json_schema)
    if kind == "regex":
        return StructuredOutputSpec("regex", sp.regex)
    if kind == "grammar":
        return StructuredOutputSpec("grammar", sp.grammar)
    if kind == "json_object":
        return StructuredOutputSpec("json_object") if sp.json_object else None
    if kind == "choice":
        return StructuredOutputSpec("choice", json.dumps(list(sp.choice.choices)))
    raise InvalidRequestError(f"SamplingParams.{kind} is not supported")  # structural_tag


# ---------------------------------------------------------------------------
# replies


def logprobs_to_proto(items: list[TokenLogprobs]) -> pb.OutputLogProbs:
    out = pb.OutputLogProbs()
    for lp in items:
        out.token_ids.append(lp.token_id)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.add(token_ids=[t for t, _ in lp.top], values=[v for _, v in lp.top])
    return out


def chunk(output: RequestOutput, num_prompt_tokens: int, num_output_tokens: int,
          with_logprobs: bool) -> pb.GenerateResponse:
    """A stream chunk: only this output's new ids; the counts so far."""
    c = pb.GenerateStreamChunk(token_ids=output.new_token_ids, prompt_tokens=num_prompt_tokens,
                               completion_tokens=num_output_tokens,
                               cached_tokens=output.num_cached_tokens)
    if with_logprobs:
        c.output_logprobs.CopyFrom(logprobs_to_proto(output.new_logprobs))
    return pb.GenerateResponse(chunk=c)


def complete(last: RequestOutput, request: Request, output_ids: list[int],
             logprobs: list[TokenLogprobs] | None) -> pb.GenerateResponse:
    """The one GenerateComplete: every output id, the finish and the counts."""
    c = pb.GenerateComplete(output_ids=output_ids, finish_reason=FINISH_REASONS[last.finish_reason],
                            prompt_tokens=request.num_prompt_tokens,
                            completion_tokens=len(output_ids),
                            cached_tokens=last.num_cached_tokens)
    # as vLLM: a stop_token_ids match is reported; the model's EOS is not
    if last.stop_token_id is not None and \
            last.stop_token_id in request.sampling_params.stop_token_ids:
        c.matched_token_id = last.stop_token_id
    if logprobs is not None:
        c.output_logprobs.CopyFrom(logprobs_to_proto(logprobs))
    return pb.GenerateResponse(complete=c)
