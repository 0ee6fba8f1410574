"""The wire mapping, one module per boundary, each for one file in protos/:

    common.py    common.proto: sampling parameters, logprobs, model facts (every hop)
    worker.py    worker.proto: scheduler <-> worker (the Step stream)
    engine.py    engine.proto: frontend <-> scheduler (the Session stream)
    generate.py  generate.proto: client <-> frontend (the gRPC Generate API)

Paired messages are mapped by shared/wire/mapper.py from their descriptors; each
module lists the messages it leaves unpaired, with the reason, in UNPAIRED (a test
fails for a message that is neither). Read-outs built at one edge from state held
under the same names (EngineStatus, RequestTimings, HandshakeResponse) are filled
by field name by shared/wire/readout.py. docs/architecture.md has the request's path.
"""
