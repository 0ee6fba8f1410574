"""Client requests -> what the scheduler gets: prompt token ids, SamplingParams,
stop strings. Every check happens here, before anything is queued; a failure is
an InvalidRequestError naming the field (HTTP 400, gRPC INVALID_ARGUMENT)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.config import DEFAULT_COMPILE_TIMEOUT_S
from shared.types import InvalidRequestError, SamplingParams

from frontend_svc.structured import response_format
from frontend_svc.structured import tools
from frontend_svc.request.caps import RequestCaps
from frontend_svc.structured.chat_template import request_template
from frontend_svc.errors import FieldError
from frontend_svc.api.protocol import (
    ChatCompletionRequest, CompletionRequest, SamplingFields, check_refused)
from frontend_svc.structured.response_format import Constraint
from frontend_svc.request.tokenizer import TextTokenizer
from frontend_svc.structured.tools import ToolConfig, ToolPlan

INT32 = 2**31
INT64 = 2**63  # the wire's seed type


@dataclass(slots=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    caps: RequestCaps = field(default_factory=RequestCaps)
    # the model's grammar vocabulary (shared.structured.compile_cache.grammar_vocab), built on
    # first use; None: structured outputs are refused
    grammar_vocab: Callable[[], object] | None = None
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S


@dataclass(slots=True)
class GenerationInput:
    """One prompt, ready for the scheduler (before fan-out into n choices)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stops: list[str] = field(default_factory=list)
    prompt_text: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    constraint: Constraint | None = None  # its structured output (params carry the spec)
    tool_plan: ToolPlan | None = None  # chat with tools: how the reply is parsed
    compile_s: float = 0.0  # validating the constraint took this long (a cache hit: ~0)
    cache_hit: bool | None = None  # that compile was a cache hit (None: no constraint)


def fan_out(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n choices; with a seed, choice i uses seed + i like the reference, so
    choices differ but the whole response is reproducible."""
    return [dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids),
                                seed=None if params.seed is None else params.seed + i)
            for i in range(n)]


def check_prompt(ids: list[int], params: SamplingParams, limits: ModelLimits) -> None:
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"prompt token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    if len(ids) + params.max_tokens > limits.max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {limits.max_model_len} tokens, "
            f"but {len(ids) + params.max_tokens} were requested ({len(ids)} in the "
            f"prompt, {params.max_tokens} in the completion); shorten the prompt "
            "or lower max_tokens")


def stop_strings(stop: str | list[str] | None, caps: RequestCaps,
                 stop_token_ids: list[int] | None = None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(s == "" for s in stops):
        raise FieldError("stop strings must not be empty", "stop")
    caps.check_stops(stops, stop_token_ids)
    return stops


def choices_per_prompt(req: SamplingFields) -> int:
    """How many choices each prompt starts: best_of when given (the n with the
    highest cumulative logprob are returned, as in vLLM), else n."""
    if req.n < 1:
        raise FieldError(f"n must be at least 1, got {req.n}", "n")
    if req.best_of is None:
        return req.n
    if req.best_of < req.n:
        raise FieldError(f"best_of must be at least n ({req.n}), got {req.best_of}", "best_of")
    if req.stream and req.best_of > req.n:
        raise FieldError("best_of greater than n cannot be streamed: the best choices are "
                         "known only when all have finished", "best_of")
    return req.best_of


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None,
                    limits: ModelLimits) -> SamplingParams:
    """SamplingParams from the shared fields; None keeps the default."""
    if not -INT32 <= req.priority < INT32:
        raise FieldError("priority must fit in 32 bits", "priority")
    given = {name: getattr(req, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty") if getattr(req, name) is not None}
    params = SamplingParams(max_tokens=max_tokens, min_tokens=req.min_tokens,
                            stop_token_ids=list(req.stop_token_ids or []),
                            ignore_eos=req.ignore_eos, logprobs=logprobs,
                            logit_bias=logit_bias(req.logit_bias), **given)
    try:
        params.validate(limits.vocab_size)
    except InvalidRequestError as exc:  # its messages start with the field's name
        name = str(exc).split(" ", 1)[0]
        raise FieldError(str(exc), name if name in type(req).model_fields else None) \
            from None
    if params.seed is not None and \
            not -INT64 <= params.seed <= INT64 - choices_per_prompt(req):
        raise FieldError("seed must fit in a signed 64-bit integer", "seed")
    return params


def encode(tokenizer: TextTokenizer, text: str, add_special_tokens: bool,
           param: str) -> list[int]:
    """Token ids of a client's text; whatever the tokenizer refuses is a 400 naming
    the field, not a 500."""
    try:
        return tokenizer.encode(text, add_special_tokens)
    except Exception as exc:  # tokenizers raises plain exceptions (TypeError, ...)
        raise FieldError(f"{param} cannot be tokenized: {exc}", param) from exc


def logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    out = {}
    for key, value in (raw or {}).items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise FieldError(f"logit_bias keys must be token ids, got {key!r}",
                             "logit_bias") from None
    return out


def _max_tokens(requested: int | None, prompt_len: int, limits: ModelLimits) -> int:
    if requested is not None:
        return requested
    # Chat's default is "as long as the context allows"; check_prompt reports a full one.
    return max(limits.max_model_len - prompt_len, 1)


def completion_inputs(req: CompletionRequest, tokenizer: TextTokenizer,
                      limits: ModelLimits) -> list[GenerationInput]:
    """One GenerationInput per prompt of a (possibly batched) completion request."""
    check_refused(req)
    constraint = response_format.request_constraint(req)
    width = choices_per_prompt(req)
    if req.echo and req.logprobs is not None:
        raise FieldError("echo with logprobs is not supported "
                         "(prompt logprobs are not computed)", "echo")
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise FieldError("the prompt is empty", "prompt")
    limits.caps.check_batch(len(prompts), width)
    stops = stop_strings(req.stop, limits.caps, req.stop_token_ids)
    for p in prompts:  # every cap before the first (costly) tokenization
        if isinstance(p, str):
            limits.caps.check_text(p)
    # ranking best_of candidates needs each token's logprob, even if not returned
    logprobs = req.logprobs if req.logprobs is not None or width == req.n else 0
    inputs = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            param = "prompt" if isinstance(req.prompt, str) else f"prompt.{i}"
            ids, text = encode(tokenizer, p, req.add_special_tokens, param), p
        else:
            ids, text = list(p), None
        params = sampling_params(req, _max_tokens(req.max_tokens, len(ids), limits),
                                 logprobs, limits)
        check_prompt(ids, params, limits)
        if text is None and req.echo:
            text = tokenizer.decode(ids, req.skip_special_tokens)
        inputs.append(GenerationInput(ids, params, stops, text,
                                      req.include_stop_str_in_output,
                                      req.skip_special_tokens, req.priority, req.cache_salt))
    return constrained(inputs, constraint)


def constrained(inputs: list[GenerationInput], constraint: Constraint | None
                ) -> list[GenerationInput]:
    """Attach the request's structured output to every input; check_constraints
    compiles it before anything is queued."""
    if constraint is not None:
        for inp in inputs:
            inp.params = dataclasses.replace(inp.params, structured_output=constraint.spec)
            inp.constraint = constraint
    return inputs


def check_constraints(inputs: list[GenerationInput], limits: ModelLimits
                      ) -> list[GenerationInput]:
    """Compile the request's grammar (the same for all its inputs; a cache hit after
    the first time) or raise the 400 naming its field. The last check before the
    scheduler: run it on the frontend's grammar pool, so a slow compile holds
    neither the event loop nor a tokenizer thread."""
    constraint = inputs[0].constraint if inputs else None
    if constraint is not None:
        compile_s, hit = response_format.check(constraint, limits.grammar_vocab,
                                          limits.compile_timeout_s)
        for inp in inputs:
            inp.compile_s, inp.cache_hit = compile_s, hit
    return inputs


def _message_dict(message) -> dict:
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    out = {"role": message.role, "content": content or ""}
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    return out


def _message_text(message: dict) -> str:
    """What a message adds to the prompt, for the prompt-size cap."""
    calls = message.get("tool_calls") or ()
    return message["content"] + "".join(str(c) for c in calls)


def check_chat_template_flags(add_generation_prompt: bool,
                              continue_final_message: bool) -> None:
    if continue_final_message and add_generation_prompt:  # vLLM's rule
        raise FieldError("continue_final_message and add_generation_prompt cannot both be "
                         "true: set add_generation_prompt to false to continue the last "
                         "message", "continue_final_message")


def chat_echo_text(req: ChatCompletionRequest, messages: list[dict]) -> str | None:
    """vLLM's chat echo: the reply starts with the last message's content when that
    message has the reply's role (assistant, or any role without a generation prompt)."""
    if not req.echo:
        return None
    last = messages[-1]
    return last["content"] if not req.add_generation_prompt or last["role"] == "assistant" \
        else ""


@dataclass(slots=True)
class ChatPrompt:
    """A chat rendered to prompt ids, with what rendering it decided."""
    ids: list[int]
    messages: list[dict]
    plan: ToolPlan | None            # the request's tools (frontend_svc/structured/tools.py)
    tool_constraint: Constraint | None  # the grammar tool_choice required/named enforces


def chat_prompt(req: ChatCompletionRequest, tokenizer: TextTokenizer, limits: ModelLimits,
                tool_config: ToolConfig | None = None) -> ChatPrompt:
    """The one rendering of a chat: the template (the model's, the tools-aware one, or
    the request's own), its kwargs, the tools and the template flags. Chat completions
    and /tokenize both call it, so /tokenize returns the ids a chat request would run."""
    tool_config = tool_config or ToolConfig()
    own, template_kwargs = request_template(req.chat_template, req.chat_template_kwargs,
                                            tool_config.trust_request_chat_template,
                                            tokenizer.special_tokens)
    if own is not None:  # the request's template replaces the model's, for tools too
        tool_config = dataclasses.replace(tool_config, template=tools.tools_template(own))
    plan, tool_constraint = tools.plan(req, tool_config)
    check_chat_template_flags(req.add_generation_prompt, req.continue_final_message)
    messages = [_message_dict(m) for m in req.messages]
    tools_text = json.dumps(plan.tools) if plan else ""  # the template renders them too
    limits.caps.check_text("".join(map(_message_text, messages)) + tools_text,
                           "the messages' content")
    template = _template(plan, messages, tool_config) or own or tokenizer.chat_template
    if template is not None and template_kwargs:
        template = template.with_kwargs(template_kwargs)
    ids = tokenizer.apply_chat_template(messages, req.add_generation_prompt,
                                        req.continue_final_message, req.add_special_tokens,
                                        plan.tools if plan else None, template)
    return ChatPrompt(ids, messages, plan, tool_constraint)


def chat_input(req: ChatCompletionRequest, tokenizer: TextTokenizer,
               limits: ModelLimits, tool_config: ToolConfig | None = None) -> GenerationInput:
    check_refused(req)
    prompt = chat_prompt(req, tokenizer, limits, tool_config)
    plan = prompt.plan
    constraint = response_format.request_constraint(req)
    if prompt.tool_constraint is not None and constraint is not None:
        raise FieldError(f"tool_choice {plan.label} enforces the tool call's own grammar; "
                         f"drop {constraint.param}", "tool_choice")
    constraint = prompt.tool_constraint or constraint
    if plan is not None and plan.parses and req.echo:
        raise FieldError("echo cannot be combined with tool calling", "echo")
    if req.top_logprobs is not None and not req.logprobs:
        raise FieldError("top_logprobs requires logprobs to be true", "top_logprobs")
    if req.top_logprobs is not None and \
            not 0 <= req.top_logprobs <= SamplingParams.MAX_LOGPROBS:
        raise FieldError(f"top_logprobs must be in [0, {SamplingParams.MAX_LOGPROBS}], "
                         f"got {req.top_logprobs}", "top_logprobs")
    width = choices_per_prompt(req)
    logprobs = (req.top_logprobs or 0) if req.logprobs or width > req.n else None
    limits.caps.check_batch(1, width)
    stops = stop_strings(req.stop, limits.caps, req.stop_token_ids)
    ids = prompt.ids
    requested = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    params = sampling_params(req, _max_tokens(requested, len(ids), limits), logprobs, limits)
    check_prompt(ids, params, limits)
    inp = GenerationInput(ids, params, stops, chat_echo_text(req, prompt.messages),
                          req.include_stop_str_in_output, req.skip_special_tokens,
                          req.priority, req.cache_salt, tool_plan=plan)
    return constrained([inp], constraint)[0]


def _template(plan: ToolPlan | None, messages: list[dict], config: ToolConfig):
    """The tools-aware template when the request has tools or tool turns in its
    history (frontend_svc/structured/tools.py), else None (the model's)."""
    turn = next((i for i, m in enumerate(messages)
                 if m.get("tool_calls") or m["role"] == "tool"), None)
    if plan is None and turn is None:
        return None
    if config.template is None and turn is not None and \
            messages[turn]["role"] == "assistant":
        raise FieldError(f"messages.{turn}.tool_calls: this model's chat template does not "
                         "render tool calls; start the frontend with --chat-template FILE",
                         f"messages.{turn}.tool_calls")
    return config.template
