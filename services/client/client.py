"""`BatonClient`: chat and text completions over the internal gRPC API, blocking, one channel per client.

Every call streams; `chat` / `complete` read the stream to its end. Leaving a `stream_*` iterator
early (break, an exception, garbage collection) cancels the call, which aborts the generation on the
cluster (the tokens so far are billed).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

import grpc

from rpcgen.baton.v1 import api_pb2 as pb
from rpcgen.baton.v1 import api_pb2_grpc as pb_grpc
from services.client.types import BatonApiError, Chunk, Completion, Message, Role, Sampling
from services.gateway.config import DEFAULT_MODEL_NAME

Messages = str | Sequence[Message]  # a str: one user message


class BatonClient:
    def __init__(self, target: str, api_key: str, *, model: str = DEFAULT_MODEL_NAME, tls: bool = False,
                 ca_cert: str | Path | None = None, timeout_s: float | None = 600.0) -> None:
        """`target`: host:port of the gateway's gRPC API. `tls`: verify the server against the system's
        roots, or `ca_cert` (a PEM file, e.g. a self-signed certificate; implies TLS)."""
        self.model = model
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {api_key}"),)
        if tls or ca_cert is not None:
            roots = Path(ca_cert).read_bytes() if ca_cert is not None else None
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots))
        else:
            self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.BatonApiStub(self._channel)

    def stream_chat(self, messages: Messages, *, sampling: Sampling | None = None, model: str | None = None,
                    user: str = "", conversation_id: str = "") -> Iterator[Chunk]:
        request = pb.ChatRequest(model=model or self.model, messages=[m.to_proto() for m in _messages(messages)],
                                 sampling=(sampling or Sampling()).to_proto(), user=user,
                                 conversation_id=conversation_id)
        return self._stream(self._stub.Chat, request)

    def chat(self, messages: Messages, *, sampling: Sampling | None = None, model: str | None = None,
             user: str = "", conversation_id: str = "") -> Completion:
        return Completion.collect(self.stream_chat(messages, sampling=sampling, model=model, user=user,
                                                   conversation_id=conversation_id))

    def stream_complete(self, prompt: str, *, sampling: Sampling | None = None, model: str | None = None,
                        echo: bool = False, user: str = "") -> Iterator[Chunk]:
        request = pb.CompleteRequest(model=model or self.model, prompt=prompt,
                                     sampling=(sampling or Sampling()).to_proto(), echo=echo, user=user)
        return self._stream(self._stub.Complete, request)

    def complete(self, prompt: str, *, sampling: Sampling | None = None, model: str | None = None,
                 echo: bool = False, user: str = "") -> Completion:
        return Completion.collect(self.stream_complete(prompt, sampling=sampling, model=model, echo=echo, user=user))

    def _stream(self, method: grpc.UnaryStreamMultiCallable,
                request: pb.ChatRequest | pb.CompleteRequest) -> Iterator[Chunk]:
        call = method(request, metadata=self._metadata, timeout=self.timeout_s)
        try:
            for message in call:
                yield Chunk.from_proto(message)
        except grpc.RpcError as e:
            raise BatonApiError.from_rpc(e) from None
        finally:
            call.cancel()  # a no-op once the call ended; else it aborts the generation

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> BatonClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _messages(messages: Messages) -> Sequence[Message]:
    return [Message(Role.USER, messages)] if isinstance(messages, str) else messages
