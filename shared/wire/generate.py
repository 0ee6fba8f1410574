"""generate.proto: the client-facing gRPC API. Nothing here is paired: its messages
are the client's shapes, read into the frontend's GenerationInput and built from its
OutputStream by frontend_svc/api/grpc_api.py (the sampling parameters and logprobs inside
them are common.proto's, paired in shared/wire/common.py)."""

_BUILT = "built from the frontend's OutputStream by frontend_svc/api/grpc_api.py"

UNPAIRED = {
    "GenerateRequest": "validated and tokenized into a GenerationInput by "
                       "frontend_svc/api/grpc_api.py (text in, a different shape out)",
    "TokenIds": "a oneof arm of GenerateRequest (proto has no repeated inside a oneof)",
    "GenerateResponse": "a delta of text and token ids, " + _BUILT,
    "GenerateFinal": "the end of a stream: finish reason, matched stop, usage; " + _BUILT,
    "Usage": "token counts, " + _BUILT,
    "RequestTimings": "per-request timings, filled by name from the choice "
                      "(shared/wire/readout.py) by frontend_svc/api/grpc_api.py",
    "AbortRequest": "a list of client ids, read in place",
    "AbortResponse": "how many ids were still running, built in place",
    "TokenizeRequest": "text, read in place",
    "TokenizeResponse": "the tokenizer's answer, built in place",
    "GetModelInfoResponse": "its ModelInfo is paired; the served name is a flag",
}
