"""Hostile HTTP/1.1 clients for server robustness workloads (bench/serving_robustness.py).

Bodies that are too large (declared, or chunked without end), that arrive slowly, or that
stall half-way. Each speaks raw HTTP over an asyncio socket, because an ordinary client
sends the whole body before it reads the answer, which hides whether the server answered
early. Each returns ``{"status", "text", "sent", "seconds"}``: ``sent`` is how many body bytes
had gone out when the answer came (status -1 and the error as text when none came).
"""

from __future__ import annotations

import asyncio
import re
import time


def _head(path: str, host: str, headers: dict[str, str], length: int | None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, str]:
    """One response with a Content-Length (what the server under test sends for JSON answers)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(None, 2)[1])
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    body = await reader.readexactly(int(m.group(1))) if m else b""
    return status, body.decode("utf-8", "replace")


async def _exchange(host, port, path, headers, length, send, timeout: float) -> dict:
    """Open a connection, run ``send(writer, answered)`` (it returns bytes sent), read the answer."""
    t0, sent = time.perf_counter(), 0
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        return {"status": -1, "text": f"{type(e).__name__}: {e}", "sent": 0, "seconds": 0.0}
    try:
        writer.write(_head(path, host, headers, length))
        answer = asyncio.ensure_future(read_response(reader))
        try:
            sent = await send(writer, answer)
        except (ConnectionError, OSError):  # the server closed while we were still sending: read what it said
            pass
        status, text = await asyncio.wait_for(answer, timeout)
    except (TimeoutError, ConnectionError, OSError, asyncio.IncompleteReadError, ValueError) as e:
        status, text = -1, f"{type(e).__name__}: {e}"
    finally:
        writer.close()
    return {"status": status, "text": text, "sent": sent, "seconds": time.perf_counter() - t0}


async def declared_oversize(host: str, port: int, path: str, declared: int, send_bytes: int = 1024,
                            headers: dict | None = None, timeout: float = 60) -> dict:
    """Declare a ``declared``-byte body, send ``send_bytes`` of it and wait for the answer."""
    async def send(writer, answer):
        writer.write(b" " * send_bytes)
        await writer.drain()
        return send_bytes

    return await _exchange(host, port, path, headers or {}, declared, send, timeout)


async def chunked_flood(host: str, port: int, path: str, cap: int = 64 << 20, chunk: int = 64 << 10,
                        headers: dict | None = None, timeout: float = 60) -> dict:
    """Send a chunked body until the server answers (or ``cap`` bytes, then end it and wait)."""
    piece = b"%x\r\n" % chunk + b" " * chunk + b"\r\n"

    async def send(writer, answer):
        sent = 0
        while not answer.done() and sent < cap:
            writer.write(piece)
            sent += chunk
            # a server that stopped reading leaves drain waiting on a full socket: look at the answer instead
            await asyncio.wait([asyncio.ensure_future(writer.drain()), answer], timeout=5,
                               return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            writer.write(b"0\r\n\r\n")
        return sent

    return await _exchange(host, port, path, headers or {}, None, send, timeout)


async def trickle(host: str, port: int, path: str, body: bytes, pieces: int = 8, delay: float = 0.25,
                  stall: bool = False, headers: dict | None = None, timeout: float = 120) -> dict:
    """Send ``body`` in ``pieces`` with ``delay`` seconds between them; ``stall``: stop half-way and wait."""
    step = max(1, -(-len(body) // pieces))
    parts = [body[i:i + step] for i in range(0, len(body), step)]
    if stall:
        parts = parts[: max(1, len(parts) // 2)]

    async def send(writer, answer):
        sent = 0
        for p in parts:
            if answer.done():
                break
            writer.write(p)
            await writer.drain()
            sent += len(p)
            await asyncio.sleep(delay)
        return sent

    return await _exchange(host, port, path, headers or {}, len(body), send, timeout)
