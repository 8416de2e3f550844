"""A TCP delay line in user space: the far-remote profile over real HTTP.

This kernel has no ``netem`` (``tc qdisc ... netem`` is an unknown kind here), so the
latency of a far object store is added by a proxy in its own process between the client
and the loopback S3 server. Every byte the client sends is held ``delay`` seconds before
it is forwarded (a delay line, not a sleep per chunk: a large upload pays the delay once,
as on a real link), and each new connection pays it once more for the handshake. A
request therefore waits one ``delay`` more than it would on loopback, which is what
"20 ms per request" means. Responses pass straight through.

The proxy costs CPU of its own (Python copies every byte twice); :class:`LatencyProxy`
reads the process's CPU seconds so a benchmark can say how much of the machine it took.

    python -m bench.common.latency_proxy --listen 0 --upstream 127.0.0.1:8333 --delay-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

from bench.common.paths import ROOT, child_env, module_argv

CHUNK = 1 << 18
QUEUE_CHUNKS = 64  # back-pressure: at most 16 MiB held in the line per connection


async def _delay_line(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float
) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

    async def take() -> None:
        while True:
            data = await reader.read(CHUNK)
            await queue.put((loop.time() + delay, data))
            if not data:
                return

    taker = asyncio.create_task(take())
    try:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        taker.cancel()
        _close(writer)


async def _straight(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        _close(writer)


def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except (ConnectionError, OSError, RuntimeError):
        pass


async def _serve(listen: socket.socket, host: str, port: int, delay: float) -> None:
    async def on_client(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        await asyncio.sleep(delay)  # the handshake's round trip
        try:
            ureader, uwriter = await asyncio.open_connection(host, port)
        except OSError:
            _close(cwriter)
            return
        for w in (cwriter, uwriter):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(_delay_line(creader, uwriter, delay), _straight(ureader, cwriter))

    server = await asyncio.start_server(on_client, sock=listen, limit=CHUNK)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=int, default=0, help="port on 127.0.0.1 (0: any)")
    parser.add_argument("--upstream", required=True, help="host:port of the real server")
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args()
    host, port = args.upstream.rsplit(":", 1)
    listen = socket.socket()
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind(("127.0.0.1", args.listen))
    listen.listen(512)
    print(listen.getsockname()[1], flush=True)  # the parent reads the port from here
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # nothing to flush
    asyncio.run(_serve(listen, host, int(port), args.delay_ms / 1000))


class LatencyProxy:
    """The delay line as a child process in front of ``upstream`` (``http://host:port``)."""

    def __init__(self, upstream: str, delay_ms: float) -> None:
        hostport = upstream.split("://", 1)[-1].rstrip("/")
        self.delay_ms = delay_ms
        self.proc = subprocess.Popen(
            module_argv("bench.common.latency_proxy", "--upstream", hostport,
                        "--delay-ms", str(delay_ms)),
            env=child_env(), cwd=ROOT,
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"latency proxy did not start (said {line!r})")
        self.endpoint_url = f"http://127.0.0.1:{int(line)}"

    def cpu_seconds(self) -> float:
        """User + system CPU the proxy process has used so far."""
        from bench.common.proc_cpu import process_cpu_seconds

        return process_cpu_seconds(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _self_check() -> None:
    """Time one GET through the proxy and straight, against a throwaway HTTP server."""
    import http.server
    import threading
    import urllib.request

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    upstream = f"http://127.0.0.1:{httpd.server_address[1]}"
    proxy = LatencyProxy(upstream, 20)
    try:
        for url in (upstream, proxy.endpoint_url):
            start = time.perf_counter()
            urllib.request.urlopen(url + "/").read()
            print(url, f"{(time.perf_counter() - start) * 1000:.1f} ms")
    finally:
        proxy.close()
        httpd.shutdown()


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-check"]:
        _self_check()
    else:
        main()
