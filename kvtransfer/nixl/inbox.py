"""`UnixInbox`: messages between the processes of one worker that must not wait for the engine's step.

The ranks of a tensor- or pipeline-parallel worker share a control group (gloo) that carries one call
at a time, serialised with the engine's steps: a call waits for the step in progress (seconds on a
loaded CPU). A WRITE order to a follower, or a follower's report of how its WRITE ended, must not
wait for that, so each travels over a Unix socket of its own: the receiving process listens
(authenticated with a random key it hands out over the control group once, at set-up) and a reader
thread per connection hands every message to `on_message` on that thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener
from typing import Any


class UnixInbox:
    """Listens at `address` (AF_UNIX) for clients knowing `authkey`; `on_message(msg)` runs on the
    reader thread of the connection the message came by, in the order that connection sent them."""

    def __init__(self, on_message: Callable[[Any], None], name: str) -> None:
        self.authkey = os.urandom(16)
        self._listener = Listener(family="AF_UNIX", authkey=self.authkey)
        self.address = str(self._listener.address)
        self._on_message = on_message
        self._name = name
        self._closed = False
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):  # closed, or a client failed authentication (keep serving)
                if self._closed:
                    return
                continue
            threading.Thread(target=self._read, args=(conn,), name=f"{self._name}-reader", daemon=True).start()

    def _read(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    return
                self._on_message(message)
