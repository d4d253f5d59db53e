"""`RecordingConnection`: an actor's connection to the inference server that keeps what it sends,
so that tests can read the sizes of the arrays an actor sends per step."""

from __future__ import annotations

from typing import Any

__all__ = ["RecordingConnection"]


class RecordingConnection:
    """Sends and receives through `conn`; `sent` holds every message sent, in order."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.sent: list[Any] = []

    def send(self, message: Any) -> None:
        self.sent.append(message)
        self.conn.send(message)

    def recv(self) -> Any:
        return self.conn.recv()

    def kept(self) -> list[tuple]:
        """The messages whose stacks the server keeps: (policy_id, obs, state, refills)."""
        return [m for m in self.sent if len(m) == 4]
