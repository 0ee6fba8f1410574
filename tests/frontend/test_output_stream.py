from frontend_svc.request.choice import Choice
from frontend_svc.request.detokenizer import IncrementalDetokenizer
from frontend_svc.request.output_stream import OutputStream
from frontend_svc.request.stops import StopStrings
from shared.types import FinishReason, RequestOutput, SamplingParams, TokenLogprobs


def make_state(tokenizer, stops=(), include=False, **params):
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    return OutputStream(Choice.for_prompt("r", prompt, SamplingParams(**params)),
                        IncrementalDetokenizer.for_prompt(tokenizer.fast, prompt),
                        StopStrings(list(stops)), include_stop_str_in_output=include)


def feed(state, out):
    """As in the frontend: the choice records the output as it arrives, then the
    stream turns it into the client's delta."""
    return state.process(state.choice.seen(out))


def feed_one_by_one(state, ids, last_finish=None, stop_token_id=None):
    deltas = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        deltas.append(feed(state, RequestOutput(
            "r", [t], finish_reason=last_finish if last else None,
            stop_token_id=stop_token_id if last else None)))
        if deltas[-1].finished:
            break
    return deltas


def test_stop_string_across_tokens_is_withheld_and_ends_the_request(tokenizer):
    ids = tokenizer.encode("Hello there. END of text", add_special_tokens=False)
    state = make_state(tokenizer, stops=["END"], max_tokens=50)
    deltas = feed_one_by_one(state, ids)
    assert "".join(d.text for d in deltas) == "Hello there. "
    assert deltas[-1].finish_reason == FinishReason.STOP and deltas[-1].stop_reason == "END"
    assert state.needs_abort  # the scheduler still runs it: the frontend must abort it
    # usage counts the tokens up to and including the one that completed the stop
    end_token = next(i for i in range(len(ids))
                     if "END" in tokenizer.decode(ids[:i + 1]))
    assert state.choice.num_completion_tokens == end_token + 1


def test_text_that_may_start_a_stop_is_held_back_then_released(tokenizer):
    state = make_state(tokenizer, stops=["\n\nUser"], max_tokens=50)
    ids = tokenizer.encode("Hi\n\nUs", add_special_tokens=False)
    sent = "".join(d.text for d in feed_one_by_one(state, ids))
    assert sent == "Hi"
    more = tokenizer.encode("ually fine", add_special_tokens=False)
    sent += "".join(d.text for d in feed_one_by_one(state, more, FinishReason.LENGTH))
    assert sent == state.text == "Hi\n\nUsually fine"
    assert not state.needs_abort and state.choice.stop_reason is None


def test_include_stop_str_in_output_keeps_the_stop(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    state = make_state(tokenizer, stops=["two"], include=True)
    assert "".join(d.text for d in feed_one_by_one(state, ids)) == "one two"


def test_tokens_after_the_stop_in_the_same_step_are_dropped(tokenizer):
    ids = tokenizer.encode("alpha STOP beta gamma", add_special_tokens=False)
    state = make_state(tokenizer, stops=["STOP"], max_tokens=50)
    delta = feed(state, RequestOutput("r", ids))
    assert delta.text == "alpha " and delta.finished
    assert tokenizer.decode(state.choice.output_token_ids).endswith("STOP")
    assert delta.token_ids == state.choice.output_token_ids


def test_stop_strings_are_ignored_before_min_tokens(tokenizer):
    ids = tokenizer.encode("a b a b", add_special_tokens=False)
    state = make_state(tokenizer, stops=["a"], min_tokens=len(ids), max_tokens=50)
    deltas = feed_one_by_one(state, ids, FinishReason.LENGTH)
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert state.text == "a b a b"


def test_scheduler_finish_reports_stop_token_id_only_when_it_was_requested(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Fine", add_special_tokens=False) + [eos]
    state = make_state(tokenizer)
    deltas = feed_one_by_one(state, ids, FinishReason.STOP, stop_token_id=eos)
    assert deltas[-1].finish_reason == FinishReason.STOP and deltas[-1].stop_reason is None
    assert state.text == "Fine" and state.choice.num_completion_tokens == len(ids)
    assert not state.needs_abort

    state = make_state(tokenizer, stop_token_ids=[42])
    deltas = feed_one_by_one(state, [ids[0], 42], FinishReason.STOP, stop_token_id=42)
    assert deltas[-1].stop_reason == 42


def test_logprobs_follow_their_tokens(tokenizer):
    ids = tokenizer.encode("x y", add_special_tokens=False)
    lps = [TokenLogprobs(t, -0.5, 1) for t in ids]
    state = make_state(tokenizer, logprobs=0)
    delta = feed(state, RequestOutput("r", ids, lps, finish_reason=FinishReason.LENGTH))
    assert [lp.token_id for lp in delta.logprobs] == ids
    assert delta.finish_name == "length"


def test_outputs_after_the_end_change_nothing(tokenizer):
    state = make_state(tokenizer)
    feed(state, RequestOutput("r", [1], finish_reason=FinishReason.LENGTH))
    delta = feed(state, RequestOutput("r", [2, 3]))
    assert delta.token_ids == [] and state.choice.output_token_ids == [1]
