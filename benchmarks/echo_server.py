"""Reference servers for the control-plane comparison, each answering a request
with a reply of a fixed size and doing nothing else:

* ``grpc``: a bare grpc.aio unary echo (raw bytes, no protobuf parsing) on
  HOST:PORT or unix:PATH, with kvsvc's server options, and a bidirectional
  stream echo beside it (one reply per request, in order);
* ``zmq``: a ZMQ ROUTER socket whose loop unpacks each msgpack request and
  sends back a msgpack reply.

``BidiEcho`` is the client side of the stream echo: the bare round trip of
kvsvc's Session transport, the floor the data-plane benchmarks judge calls by.

    python -m benchmarks.echo_server grpc --listen 127.0.0.1:0 --reply-bytes 60
    python -m benchmarks.echo_server zmq --listen 127.0.0.1:0 --reply-bytes 60

Prints ``serving on ADDRESS`` once it accepts requests; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

ECHO_METHOD = "/bench.Echo/Echo"
ECHO_STREAM = "/bench.Echo/Stream"
#: Bytes of a one-chunk block Store request and its reply on the wire (about: a
#: header, a mapping id, a key, a block id; a result with a transfer id), for the echo.
REQUEST_BYTES, REPLY_BYTES = 160, 120


class BidiEcho:
    """A sync bidi-stream echo call: one request in, one reply out, in order
    (a context manager: ``close`` ends the stream, so gRPC's thread that reads the
    requests is not left waiting for one)."""

    def __init__(self, channel: grpc.Channel, payload: bytes) -> None:
        self.q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.payload = payload
        self.replies = channel.stream_stream(ECHO_STREAM)(self._requests())

    def _requests(self) -> Iterator[bytes]:
        while (item := self.q.get()) is not None:
            yield item

    def __call__(self) -> None:
        self.q.put(self.payload)
        next(self.replies)

    def close(self) -> None:
        self.q.put(None)
        self.replies.cancel()

    def __enter__(self) -> BidiEcho:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def serve_grpc(listen: str, reply: bytes) -> None:
    from kvsvc.limits import server_options

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return reply

    async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        async for _ in requests:
            yield reply

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
        },
    )
    server = grpc.aio.server(options=server_options())
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(listen)
    if port == 0 and not listen.startswith("unix:"):
        raise SystemExit(f"cannot listen on {listen}")
    await server.start()
    address = listen if listen.startswith("unix:") else f"{listen.rsplit(':', 1)[0]}:{port}"
    print(f"serving on {address} (grpc echo, {len(reply)} byte replies)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def serve_zmq(listen: str, reply_bytes: int) -> None:
    import msgpack
    import zmq

    host, _, port = listen.rpartition(":")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if port == "0":
        bound = sock.bind_to_random_port(f"tcp://{host}")
    else:
        sock.bind(f"tcp://{host}:{port}")
        bound = int(port)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    print(f"serving on {host}:{bound} (zmq ROUTER + msgpack, {reply_bytes} byte replies)",
          flush=True)  # fmt: skip
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stopping:
        if not poller.poll(200):
            continue
        frames = sock.recv_multipart()
        request = msgpack.unpackb(frames[-1])
        body = msgpack.packb({"hits": len(request.get("keys", ())), "pad": b"\0" * reply_bytes})
        sock.send_multipart([*frames[:-1], body])
    sock.close(0)
    ctx.term()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["grpc", "zmq"])
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT, or unix:PATH (grpc)")
    ap.add_argument("--reply-bytes", type=int, default=64, help="size of each reply")
    args = ap.parse_args()
    if args.kind == "grpc":
        asyncio.run(serve_grpc(args.listen, b"\x5a" * args.reply_bytes))
    else:
        if args.listen.startswith("unix:"):
            print("the zmq echo listens on HOST:PORT only", file=sys.stderr)
            return 2
        serve_zmq(args.listen, args.reply_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
