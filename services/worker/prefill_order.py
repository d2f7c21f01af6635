"""`PrefillOrder`: one remote prefill, as both workers see it.

The decode worker writes it (`RemotePrefill.order`: its blocks for the prompt's uncached tokens, its KV
agent, the WRITE's deadline), the Prefill RPC carries it (protos: `PrefillRequest`; `to_proto` /
`from_proto` here), and the prefill worker runs it (`PrefillService.prefill`). One name for the
concept on both sides of the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from rpcgen.baton.v1 import worker_pb2 as pb
from services.rpc import convert

_DEFAULT_TRANSFER_TIMEOUT_S = 10.0  # an order from a peer that left it unset


@dataclass(frozen=True)
class PrefillOrder:
    request_id: str  # the decode worker's engine id of this attempt: the prefill job's and the WRITE's id
    attempt: int  # retries use a new attempt, so a late notice of an old one is ignored
    prompt: list[int]
    params: SamplingParams
    remote_block_ids: tuple[int, ...]  # the decode worker's blocks for prompt tokens [num_cached_tokens, end)
    num_cached_tokens: int  # served by the decode worker's prefix cache: not prefilled remotely, not sent
    decode_agent: str  # the decode worker's KV agent (the handshake's name): where the WRITE goes
    transfer_timeout_s: float  # the WRITE's deadline on the prefill worker
    traceparent: str = ""  # W3C trace context of the request, forwarded as gRPC metadata
    choice_params: tuple[SamplingParams, ...] = ()  # n > 1: the other choices' first-token settings
    # The decode worker reserves while this runs: remote_block_ids / num_cached_tokens come later, in a
    # `PrefillDestination` (then `with_destination`); nothing is written before it.
    destination_follows: bool = False

    def with_destination(self, destination: PrefillDestination) -> PrefillOrder:
        return replace(self, remote_block_ids=destination.remote_block_ids,
                       num_cached_tokens=destination.num_cached_tokens, destination_follows=False)

    def to_proto(self) -> pb.PrefillRequest:
        """The Prefill RPC's request (the trace context travels as gRPC metadata, not in it)."""
        return pb.PrefillRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt, sampling=convert.sampling_to_proto(self.params),
            decode_agent=self.decode_agent, remote_block_ids=list(self.remote_block_ids),
            num_cached_tokens=self.num_cached_tokens, attempt=self.attempt, transfer_timeout_s=self.transfer_timeout_s,
            choice_sampling=[convert.sampling_to_proto(p) for p in self.choice_params],
            destination_follows=self.destination_follows)

    @classmethod
    def from_proto(cls, msg: pb.PrefillRequest, traceparent: str = "") -> PrefillOrder:
        """Raises InvalidRequestError for a request no prefill worker can run."""
        if not msg.request_id:
            raise InvalidRequestError("request_id is empty")
        return cls(msg.request_id, msg.attempt, convert.prompt_from_proto(msg.prompt_token_ids),
                   convert.sampling_from_proto(msg.sampling), tuple(msg.remote_block_ids), msg.num_cached_tokens,
                   msg.decode_agent, msg.transfer_timeout_s or _DEFAULT_TRANSFER_TIMEOUT_S, traceparent,
                   tuple(convert.sampling_from_proto(p) for p in msg.choice_sampling), msg.destination_follows)


@dataclass(frozen=True)
class PrefillDestination:
    """Where a `destination_follows` order writes: the decode worker's reserved blocks."""

    request_id: str
    attempt: int
    remote_block_ids: tuple[int, ...]
    num_cached_tokens: int

    def to_proto(self) -> pb.PrefillDestinationRequest:
        return pb.PrefillDestinationRequest(request_id=self.request_id, attempt=self.attempt,
                                            remote_block_ids=list(self.remote_block_ids),
                                            num_cached_tokens=self.num_cached_tokens)

    @classmethod
    def from_proto(cls, msg: pb.PrefillDestinationRequest) -> PrefillDestination:
        return cls(msg.request_id, msg.attempt, tuple(msg.remote_block_ids), msg.num_cached_tokens)
