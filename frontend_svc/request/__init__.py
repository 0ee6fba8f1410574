"""One request, from the door to its last delta.

    translate.py       validation at the door: request -> prompt ids, SamplingParams, stops
    context.py         what both APIs share; runs a request's n choices
    generation.py      one choice: add, stream deltas, abort when the client goes away
    output_stream.py   token ids -> text deltas, stop strings, usage, timings
    detokenizer.py     incremental detokenization    stops.py   stop strings and holdback
    tokenizer.py       tokenizer + chat template (structured/chat_template.py), no torch
    caps.py            per-request bounds (400)      admission.py   --max-queued-requests (429)
"""
