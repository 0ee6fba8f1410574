"""Python modules generated from protos/ by `python -m shared.proto.gen`.

Do not edit the *_pb2*.py files by hand; change protos/ and regenerate.
tests/wire/test_protos_fresh.py fails if they are stale.
"""
