"""Properties over arbitrary text (hypothesis): streaming never changes the text,
and a stop string cuts it exactly where the stop first appears."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend_svc.request.choice import Choice
from frontend_svc.request.detokenizer import IncrementalDetokenizer
from frontend_svc.request.output_stream import OutputStream
from frontend_svc.request.stops import StopStrings
from shared.types import FinishReason, RequestOutput, SamplingParams

# letters, CJK, emoji and combining marks: many split across byte-level BPE tokens
ALPHABET = st.sampled_from(list("ab c\n.,") + ["é", "ü", "中", "文", "😀", "🇫", "🇷", "\u0301", "—"])
TEXT = st.text(ALPHABET, min_size=1, max_size=40)
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(text=TEXT, prompt=st.text(ALPHABET, max_size=10))
def test_streamed_deltas_always_concatenate_to_the_full_decode(tokenizer, text, prompt):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer.for_prompt(tokenizer.fast,
                                              tokenizer.encode(prompt, add_special_tokens=False))
    pieces = [detok.step(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)


@SETTINGS
@given(text=TEXT, stop=st.text(ALPHABET, min_size=1, max_size=4))
def test_stop_string_cuts_the_output_where_it_first_appears(tokenizer, text, stop):
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    state = OutputStream(Choice.for_prompt("r", [1], SamplingParams(max_tokens=len(ids))),
                         IncrementalDetokenizer.for_prompt(tokenizer.fast, [1]),
                         StopStrings([stop]))
    sent = ""
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        delta = state.process(RequestOutput("r", [t], finish_reason=FinishReason.LENGTH
                                            if last else None))
        sent += delta.text
        if delta.finished:
            break
    expected = full[:full.index(stop)] if stop in full else full
    assert sent == expected
    assert (state.choice.stop_reason == stop) == (stop in full)
