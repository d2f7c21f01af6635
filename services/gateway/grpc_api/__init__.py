"""The internal gRPC API (protos/baton/v1/api.proto): chat and text completions for internal callers.

It runs in the gateway process on its own port (`BATON_GRPC_PORT`, optional TLS) and calls the very
`CompletionService` the HTTP routes call, so admission, safety, routing, billing and streaming are one
code path: `requests.py` turns a call into the HTTP API's validated request, `servicer.py` follows the
completion's event log, `chunks.py` turns its chunks into messages and `status.py` turns typed errors
into gRPC statuses. `server.py` owns the server's lifecycle.
"""
