"""The generated gRPC/protobuf code of protos/ (`rpcgen/baton/v1/*_pb2*.py`), below every package that speaks it.

Only `codegen.py` is written by hand; it regenerates the stubs (`python -m rpcgen.codegen`). Nothing here
imports Baton code, so the scheduler, the services and the tests can all import it without pulling each
other in (an import-linter contract in pyproject.toml keeps it so).
"""
