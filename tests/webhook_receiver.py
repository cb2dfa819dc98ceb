"""A real HTTP receiver of webhook calls for the tests: a ``ThreadingHTTPServer`` on a free loopback port, in a
thread. It records every POST (headers and raw body) and answers with the next status of ``answers`` (then 200)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from service.security.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify


@dataclass
class Call:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    def signed_with(self, secret: str) -> bool:
        return verify(secret, int(self.headers[TIMESTAMP_HEADER]), self.body, self.headers[SIGNATURE_HEADER])


@dataclass
class Receiver:
    url: str
    answers: list[int] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_for(self, pred: Callable[[list[Call]], bool], *, timeout_s: float = 30.0) -> list[Call]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                calls = list(self.calls)
            if pred(calls):
                return calls
            if time.monotonic() > deadline:
                raise AssertionError(f"the receiver did not get the expected calls within {timeout_s}s: {calls}")
            time.sleep(0.05)


@contextmanager
def receiver() -> Iterator[Receiver]:
    state: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            rec = state["r"]
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with rec.lock:
                rec.calls.append(Call(self.path, {k: v for k, v in self.headers.items()}, body))
                code = rec.answers.pop(0) if rec.answers else 200
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state["r"] = Receiver(url=f"http://127.0.0.1:{server.server_address[1]}/hook")
    thread = threading.Thread(target=server.serve_forever, name="webhook-receiver", daemon=True)
    thread.start()
    try:
        yield state["r"]
    finally:
        server.shutdown()
        server.server_close()
