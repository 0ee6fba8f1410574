"""Speculative decoding on the worker (docs/spec_decode.md): the proposers that fill the
scheduler's draft slots and the verification math, as pure functions over numpy arrays
and torch tensors. Not wired into the runner yet."""
