"""The scheduler core at the process edge: gRPC service, clock, metrics, protobuf conversion.

The only part of `scheduler/` allowed to import grpc (docs/architecture.md: import rules). Run the service
with `python -m scheduler.adapters` or `baton scheduler` (scheduler/adapters/main.py).
"""
