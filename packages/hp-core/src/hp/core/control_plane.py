"""The controller's wire: signed JSON over HTTP, served on the interface it is given.

``POST /v1/<verb>`` with a JSON object body and an ``X-HP-Signature`` header
(:mod:`hp.core.auth`). Answers are JSON objects; refusals carry ``error`` and use 400 (malformed),
401 (unauthenticated), 403 (not a member), 404 (unknown verb) or 409 (stale generation, wrong
job state). Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hp.core import auth
from hp.core.controller import Controller, Refused
from hp.core.errors import ControlPlaneError

log = logging.getLogger("hp.controller")
MAX_BODY_BYTES = 1 << 20


class _Handler(BaseHTTPRequestHandler):
    server: ControlServer

    def log_message(self, fmt: str, *args) -> None:  # route http.server's access log to logging
        log.debug("%s " + fmt, self.client_address[0], *args)

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 (http.server naming)
        controller = self.server.controller
        verb = self.path.removeprefix("/v1/") if self.path.startswith("/v1/") else None
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if verb is None or not 0 <= length <= MAX_BODY_BYTES:
            controller.record_refusal(str(self.path), 400, "malformed request (path or length)")
            return self._reply(400, {"error": "malformed request: POST /v1/<verb> with a JSON body"})
        body = self.rfile.read(length)
        try:
            payload = auth.verify_request(self.server.token, body, self.headers.get(auth.SIGNATURE_HEADER))
        except auth.AuthError as e:
            controller.record_refusal(verb, 401, f"unauthenticated from {self.client_address[0]}: {e}")
            return self._reply(401, {"error": f"unauthenticated: {e}"})
        try:
            self._reply(200, controller.handle(verb, payload))
        except Refused as r:
            self._reply(r.status, {"error": r.message, **r.extra})
        except Exception as e:  # a controller bug must answer, not leave the agent retrying
            log.exception("controller failed on %s", verb)
            self._reply(500, {"error": f"controller error on {verb}: {type(e).__name__}: {e}"})

    def do_GET(self) -> None:  # noqa: N802
        self.server.controller.record_refusal(self.path, 405, "GET is not served")
        self._reply(405, {"error": "use POST /v1/<verb> with a signed JSON body"})


class ControlServer(ThreadingHTTPServer):
    """Serves a :class:`Controller` on ``host:port`` and fails nodes that stop heartbeating."""

    daemon_threads = True

    def __init__(self, controller: Controller, token: str, host: str, port: int = 0,
                 liveness_period_s: float = 0.2) -> None:
        super().__init__((host, port), _Handler)
        self.controller, self.token = controller, token
        self._stop = threading.Event()
        self._loops = [
            threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True),
            threading.Thread(target=self._watch, args=(liveness_period_s,), daemon=True),
        ]

    @property
    def endpoint(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> ControlServer:
        for t in self._loops:
            t.start()
        return self

    def _watch(self, period: float) -> None:
        while not self._stop.wait(period):
            self.controller.check_liveness()

    def stop(self) -> None:
        self._stop.set()
        self.shutdown()
        self.server_close()


class ControlClient:
    """What agents (and later workers) use to talk to the controller."""

    def __init__(self, endpoint: str, token: str, timeout_s: float = 10.0) -> None:
        self.endpoint, self._token, self._timeout = endpoint, token, timeout_s
        # The controller is reached directly: an http_proxy meant for package downloads must not apply.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def call(self, verb: str, payload: dict) -> dict:
        """Send one request; returns the answer or raises :class:`ControlPlaneError`."""
        body, signature = auth.encode_request(self._token, payload)
        request = urllib.request.Request(
            f"http://{self.endpoint}/v1/{verb}", data=body, method="POST",
            headers={"Content-Type": "application/json", auth.SIGNATURE_HEADER: signature},
        )
        try:
            with self._opener.open(request, timeout=self._timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            try:
                answer = json.loads(e.read())
            except ValueError:
                answer = {}
            raise ControlPlaneError(
                f"controller refused {verb}: {answer.get('error', e.reason)}", e.code, answer
            ) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ControlPlaneError(f"controller at {self.endpoint} unreachable: {reason}") from None
