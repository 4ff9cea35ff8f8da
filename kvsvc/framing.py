"""The framing both ends of a connection share, beside the generated messages:
the Session stream's batches (one message carrying the next ones in ``more``,
when both ends announce ``SESSION_BATCH``) and the fd socket's messages (the
magic a client sends with its fd, and the broker's one-byte-tagged replies)."""

from __future__ import annotations

from typing import Any, TypeVar

from kvsvc.errors import KVServiceError, to_remote_error
from kvsvc.v1 import kv_cache_service_pb2 as pb

# --- the Session stream ---
#: Metadata both ends send (the client when it opens the stream, the server in its
#: initial metadata) when they read and write batches (``more``).
SESSION_BATCH = "kvsvc-session-batch"
#: A batch stays under this many bytes (a bigger request or answer, inline data,
#: goes alone).
BATCH_BYTES = 1 << 20
#: Metadata of a unary inline Store of at least BATCH_BYTES: its size in bytes, so
#: the server can refuse it (capacity, --inline-budget-bytes) before it asks gRPC
#: for the message; HTTP/2 flow control keeps the rest with the client meanwhile.
#: Such a Store goes unary, not as one Session frame the stream would have to take.
REQUEST_BYTES = "kvsvc-request-bytes"
#: The unary RPCs a session carries -> their SessionRequest/SessionResponse field.
FIELDS = {"Lookup": "lookup", "Store": "store", "Retrieve": "retrieve", "Fence": "fence"}

M = TypeVar("M", pb.SessionRequest, pb.SessionResponse)


def speaks_batches(metadata: Any) -> bool:
    """Whether the other end's metadata (any of grpc's forms) says it reads batches."""
    return any(key == SESSION_BATCH and value == "1" for key, value in metadata or ())


def batched(messages: list[M]) -> list[M]:
    """The messages as batches of up to BATCH_BYTES, in order: each batch is its
    first message carrying the next ones in ``more``."""
    out: list[M] = []
    size = 0
    for message in messages:
        n = message.ByteSize()
        if out and size + n <= BATCH_BYTES:
            out[-1].more.append(message)
            size += n
        else:
            out.append(message)
            size = n
    return out


# --- the fd socket (kvsvc.client.fdpass sends, kvsvc.server.data.fdbroker answers) ---
MAGIC = b"kvsvc-fd/1"
LEASE_MAGIC = b"kvsvc-fd/L"  # same length: the server reads one more byte to see extras
#: A lease pass of a plain shared-memory file, one that cannot be sealed (vLLM's
#: /dev/shm offload file): the server copies it with positional I/O, never mmap.
FILE_LEASE_MAGIC = b"kvsvc-fd/F"
TOKEN_REPLY = b"\0"
ERROR_REPLY = b"\1"


def token_reply(token: str) -> bytes:
    """The broker's answer to an fd it holds."""
    return TOKEN_REPLY + token.encode()


def error_reply(exc: KVServiceError) -> bytes:
    """The broker's answer to an fd it refused, as the one error envelope."""
    return ERROR_REPLY + to_remote_error(exc, "").SerializeToString()
