"""The Python client of Baton's internal gRPC API (protos/baton/v1/api.proto).

    from services.client import BatonClient, Message, Role, Sampling

    with BatonClient("127.0.0.1:8001", api_key="bt-...") as client:
        reply = client.chat([Message(Role.USER, "Hello")], sampling=Sampling(max_tokens=32))
        print(reply.text, reply.usage)
        for chunk in client.stream_chat("Tell me a story"):
            print(chunk.text, end="", flush=True)

Failures raise `BatonApiError` (the gRPC status plus Baton's error code, the field at fault and the
retry delay). `baton api chat` / `baton api complete` (cli.py) are this client on the command line.
"""

from services.client.client import BatonClient
from services.client.types import (
    BatonApiError,
    Choice,
    Chunk,
    Completion,
    Finish,
    Message,
    Role,
    Sampling,
    TokenLogprob,
    Usage,
)

__all__ = ["BatonApiError", "BatonClient", "Choice", "Chunk", "Completion", "Finish", "Message", "Role", "Sampling",
           "TokenLogprob", "Usage"]
