"""Structured outputs (docs/structured_outputs.md), as vLLM's v1/structured_output:
spec.py is what a request asks (no dependencies: the wire types import it);
backend.py the one interface a grammar engine implements (compile, matcher, fill
bitmask, accept, rollback, terminated); llguidance_backend.py the engine we use;
compile_cache.py the process's cache and compile threads in front of it."""
