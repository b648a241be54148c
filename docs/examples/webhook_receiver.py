"""A kvguard webhook receiver that acts only on fresh, signed, first deliveries.

Standard library only. Run it with the secret kvguard signs with ([webhook]
secret_file) and point [webhook] urls at http://HOST:PORT/:

    python3 webhook_receiver.py /etc/kvguard/webhook-secret 127.0.0.1 8080

Each delivery is checked in this order (docs/integrations.md, "Webhooks"):

1. ``X-Kvguard-Signature: t=<unix seconds>,v1=<hex>`` must hold a ``v1`` equal to
   the HMAC-SHA256, under the secret, of ``t``, a ``.`` and the raw body: else 401.
2. ``t`` must be within ``TOLERANCE_S`` of this host's clock: else 401, so a
   delivery captured earlier cannot be replayed later.
3. The body's ``event_id`` must not have been accepted before: else 200 and nothing
   is done, so a replay inside the tolerance does nothing either (and kvguard, whose
   retry of a delivery that did arrive gets 200, stops retrying).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

TOLERANCE_S = 300  # how far a delivery's t may be from this host's clock, either way
MAX_BODY_BYTES = 1024 * 1024  # kvguard's events are a few hundred bytes
SIGNATURE_HEADER = "X-Kvguard-Signature"

log = logging.getLogger("webhook_receiver")


class Refused(Exception):  # noqa: N818 - a verdict, not a failure of this program
    """A delivery not to act on: ``status`` is the HTTP answer, ``reason`` says why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class Verifier:
    """Checks deliveries: the signature, the timestamp, and event ids seen before.

    One per process. Several processes behind one URL need one shared store of ids
    (a Redis ``SET event_id 1 NX EX 600``, a unique database column) instead.
    """

    def __init__(
        self,
        secret: bytes,
        tolerance_s: float = TOLERANCE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.secret = secret
        self.tolerance_s = tolerance_s
        self.clock = clock
        self._seen: dict[str, int] = {}  # event_id: the newest t it came with
        self._lock = threading.Lock()

    def verify(self, body: bytes, signature: str | None) -> dict[str, Any]:
        """The event in ``body``, if it is kvguard's, fresh and new; else :class:`Refused`."""
        timestamp, signatures = parse_signature(signature or "")
        signed = f"{timestamp}.".encode("ascii") + body
        expected = hmac.new(self.secret, signed, hashlib.sha256).hexdigest()
        if not any(hmac.compare_digest(expected, candidate) for candidate in signatures):
            raise Refused(401, "bad signature")
        now = self.clock()
        if abs(now - timestamp) > self.tolerance_s:
            raise Refused(401, f"stale: t is {timestamp - now:+.0f} s from this clock")
        event = json.loads(body)
        if not isinstance(event, dict) or not isinstance(event.get("event_id"), str):
            raise Refused(400, "no event_id")
        event_id: str = event["event_id"]
        with self._lock:
            # An id can be forgotten once every delivery that carried it is stale:
            # step 2 refuses a replay of those, so memory stays bounded.
            self._seen = {seen: t for seen, t in self._seen.items() if t + self.tolerance_s >= now}
            first = event_id not in self._seen
            self._seen[event_id] = max(timestamp, self._seen.get(event_id, timestamp))
        if not first:
            raise Refused(200, f"event {event_id} already received")
        return event


def parse_signature(header: str) -> tuple[int, list[str]]:
    """``t`` and every ``v1`` of ``header``; other schemes are ignored (401 if unusable)."""
    timestamps: list[str] = []
    signatures: list[str] = []
    for item in header.split(","):
        key, _, value = item.strip().partition("=")
        if key == "t":
            timestamps.append(value)
        elif key == "v1":
            signatures.append(value)
    if len(timestamps) != 1 or not re.fullmatch(r"[0-9]{1,12}", timestamps[0]) or not signatures:
        raise Refused(401, f"no usable {SIGNATURE_HEADER} header")
    return int(timestamps[0]), signatures


def make_server(
    host: str, port: int, verifier: Verifier, on_event: Callable[[dict[str, Any]], object]
) -> ThreadingHTTPServer:
    """An HTTP server that answers POSTs and calls ``on_event`` with each accepted event."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = self.headers.get("Content-Length", "")
            if not length.isdigit() or not 0 < int(length) <= MAX_BODY_BYTES:
                self._answer(413, "body missing or too large")
                return
            body = self.rfile.read(int(length))  # the raw bytes: verify before parsing
            try:
                event = verifier.verify(body, self.headers.get(SIGNATURE_HEADER))
            except Refused as refused:
                log.warning("refused: %s", refused.reason)
                self._answer(refused.status, refused.reason)
                return
            except ValueError:  # signed, yet not JSON: not kvguard's
                self._answer(400, "not JSON")
                return
            on_event(event)
            self._answer(200, "ok")

        def _answer(self, status: int, text: str) -> None:
            data = text.encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
            log.debug(format, *args)

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str]) -> None:
    """``webhook_receiver.py SECRET_FILE [HOST] [PORT]``: serve until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    secret = Path(argv[0]).read_bytes().strip()  # as kvguard reads it
    host = argv[1] if len(argv) > 1 else "127.0.0.1"
    port = int(argv[2]) if len(argv) > 2 else 8080
    verifier = Verifier(secret)

    def on_event(event: dict[str, Any]) -> None:
        # Act on the event here: page someone, annotate a dashboard, open a ticket.
        log.info("%s %s %s", event["event_id"], event["event"], event.get("level", ""))

    with make_server(host, port, verifier, on_event) as server:
        server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
