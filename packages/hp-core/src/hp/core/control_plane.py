"""The controller's wire: signed JSON over HTTP, served on the interface it is given.

``POST /v1/<verb>`` with a JSON object body. Every request is signed by one *identity*, named in the
``X-HP-Node`` header: a node's agent, and the workers and spares of that node, are the node (its node
rank in decimal, e.g. ``"3"``); operator tools (``hp scale``) are ``"operator"``. Its key is
``HMAC-SHA256(job token, "hp-node:" + identity)`` (:func:`hp.core.auth.node_key`); the token never
crosses the wire.

- ``X-HP-Signature``: HMAC-SHA256(key, ``"hp-request\\n" POST "\\n" /v1/<verb> "\\n" body``): the verb
  and path are signed with the body, so a body cannot be replayed to another verb. The body carries
  ``ts`` (within ±300 s of the controller's clock) and a random ``nonce``: the server keeps the nonces
  it accepted (:class:`hp.core.auth.ReplayWindow`), so each request is accepted once.
- The server derives the key from the header's identity, and refuses (403) a request whose
  ``node_rank`` is not that identity's: a node's key speaks for that node only, and ``operator`` for none.
- ``X-HP-Response-Signature`` on every answer to a request whose signature verified (refusals
  included): HMAC-SHA256(key, ``"hp-response\\n" status "\\n" nonce "\\n" body``) with the request's key
  and nonce. :class:`ControlClient` checks it before it uses an answer: a forged, altered or replayed
  answer (another request's) is never acted on. A request that fails authentication gets an unsigned 401.

Answers are JSON objects; refusals carry ``error`` and use 400 (malformed), 401 (unauthenticated,
replayed), 403 (not a member, or speaking for another node), 404 (unknown verb), 408 (too slow) or 409
(stale generation, wrong job state). Nothing is ever unpickled.

Limits: a request must arrive whole within ``request_timeout_s`` (a slowloris client is cut off), at
most ``max_connections`` are served at once (more are closed at once), and refusals are counted
(:attr:`ControlServer.refusals`) but logged at a bounded rate: the first few of each interval one by
one, the rest in one summary line (:class:`RefusalLog`).
"""

from __future__ import annotations

import io
import json
import logging
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hp.core import auth
from hp.core.controller import Controller, Refused
from hp.core.errors import ControlPlaneError

log = logging.getLogger("hp.controller")
MAX_BODY_BYTES = 1 << 20


class RefusalLog:
    """Counts refused requests; logs (through the controller's decision log) the first ``burst`` of each
    ``interval_s`` one by one and the rest as one summary line: a flood of bad requests costs counters,
    not a log line each. Thread-safe."""

    def __init__(self, controller: Controller, burst: int = 5, interval_s: float = 10.0) -> None:
        self.controller, self.burst, self.interval_s = controller, burst, interval_s
        self.total = 0
        self.by_status: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._start, self._logged, self._held = time.monotonic(), 0, Counter()

    def count(self, status: int) -> None:
        """A refusal the controller logged itself (of an authenticated request)."""
        with self._lock:
            self.total += 1
            self.by_status[status] += 1

    def refuse(self, what: str, status: int, message: str) -> None:
        with self._lock:
            self.total += 1
            self.by_status[status] += 1
            summary = self._roll(False)
            one_by_one = self._logged < self.burst
            if one_by_one:
                self._logged += 1
            else:
                self._held[status] += 1
        self._emit(summary)
        if one_by_one:
            self.controller.record_refusal(what, status, message)

    def flush(self, force: bool = False) -> None:
        """Log the summary of the interval if it is over (or now, ``force``)."""
        with self._lock:
            summary = self._roll(force)
        self._emit(summary)

    def _roll(self, force: bool) -> tuple[Counter, float] | None:
        now = time.monotonic()
        if not force and now - self._start < self.interval_s:
            return None
        held, span = self._held, now - self._start
        self._start, self._logged, self._held = now, 0, Counter()
        return (held, span) if held else None

    def _emit(self, summary: tuple[Counter, float] | None) -> None:
        if summary is None:
            return
        held, span = summary
        statuses = ", ".join(f"{n} x {s}" for s, n in sorted(held.items()))
        self.controller.record_refusal(
            "requests", held.most_common(1)[0][0],
            f"{sum(held.values())} more refused in {span:.1f} s, not logged one by one ({statuses}); "
            f"{self.total} refused since the start")


class _Deadline(io.RawIOBase):
    """A connection's reads, all before one deadline: a client that trickles its request is cut off."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._sock, self._end, self.expired = sock, time.monotonic() + seconds, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._end - time.monotonic()
        if left <= 0:
            self.expired = True
            raise TimeoutError("request incomplete at its deadline")
        self._sock.settimeout(left)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            self.expired = True
            raise


def _claimed(payload: dict, node: str) -> str | None:
    """Why ``payload`` (signed by identity ``node``) speaks for a node that is not ``node``; None if it does not."""
    if "node_rank" not in payload:
        return None
    claimed = payload["node_rank"]
    if type(claimed) is int and node == str(claimed):  # "3" speaks for 3; "03" and "operator" for nobody
        return None
    return f"identity {node!r} cannot speak for node {claimed!r}"


class _Handler(BaseHTTPRequestHandler):
    server: ControlServer
    timeout = 5.0  # per socket operation; the whole request has ControlServer.request_timeout_s

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain reader: every read goes through the deadline instead
        self._deadline = _Deadline(self.connection, self.server.request_timeout_s)
        self.rfile = io.BufferedReader(self._deadline)
        self._key: str | None = None  # the key of a request that verified: its answer is signed with it
        self._nonce = ""

    def handle(self) -> None:
        super().handle()
        if self._deadline.expired:
            self.server.refusals.refuse("connection", 408, f"request from {self.client_address[0]} incomplete after "
                                                           f"{self.server.request_timeout_s:g} s: dropped")

    def log_message(self, fmt: str, *args) -> None:  # route http.server's access log to logging
        log.debug("%s " + fmt, self.client_address[0], *args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # malformed HTTP (request line, headers, method): http.server answers, it is counted here
        self.server.refusals.refuse(str(getattr(self, "command", None) or "request"), code,
                                    f"malformed HTTP from {self.client_address[0]}: {message or code}")
        super().send_error(code, message, explain)

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.connection.settimeout(self.server.request_timeout_s)  # a client that does not read: bounded too
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self._key is not None:
            self.send_header(auth.RESPONSE_SIGNATURE_HEADER, auth.sign_response(self._key, status, body, self._nonce))
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, what: str, status: int, message: str, error: str) -> None:
        self.server.refusals.refuse(what, status, message)
        self._reply(status, {"error": error})

    def do_POST(self) -> None:  # noqa: N802 (http.server naming)
        srv = self.server
        verb = self.path.removeprefix("/v1/") if self.path.startswith("/v1/") else None
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if verb is None or not 0 <= length <= MAX_BODY_BYTES:
            return self._refuse(str(self.path)[:100], 400, "malformed request (path or length)",
                                "malformed request: POST /v1/<verb> with a JSON body")
        body = self.rfile.read(length)
        node = self.headers.get(auth.NODE_HEADER, "")
        try:
            key = auth.node_key(srv.token, node)
            payload = auth.verify_request(key, body, self.headers.get(auth.SIGNATURE_HEADER),
                                          method="POST", path=self.path)
        except auth.AuthError as e:
            return self._refuse(verb, 401, f"unauthenticated from {self.client_address[0]}: {e}",
                                f"unauthenticated: {e}")
        self._key, self._nonce = key, payload.get("nonce") if isinstance(payload.get("nonce"), str) else ""
        if (problem := _claimed(payload, node)) is not None:
            return self._refuse(verb, 403, f"from {self.client_address[0]}: {problem}", problem)
        try:
            srv.replay.check(payload)
        except auth.AuthError as e:
            return self._refuse(verb, 401, f"from {self.client_address[0]} as {node!r}: {e}", f"unauthenticated: {e}")
        try:
            self._reply(200, srv.controller.handle(verb, payload))
        except Refused as r:  # logged by the controller
            srv.refusals.count(r.status)
            self._reply(r.status, {"error": r.message, **r.extra})
        except Exception as e:  # a controller bug must answer, not leave the agent retrying
            log.exception("controller failed on %s", verb)
            self._reply(500, {"error": f"controller error on {verb}: {type(e).__name__}: {e}"})

    def do_GET(self) -> None:  # noqa: N802
        self._refuse(self.path[:100], 405, "GET is not served", "use POST /v1/<verb> with a signed JSON body")


class ControlServer(ThreadingHTTPServer):
    """Serves a :class:`Controller` on ``host:port`` and fails nodes that stop heartbeating.

    ``request_timeout_s``: a request must arrive whole within it; ``max_connections``: connections
    served at once (more are closed at once, counted as refusals); ``replay_cap``: the nonces remembered
    (about 300 s of requests; past it requests are refused until old ones expire)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, controller: Controller, token: str, host: str, port: int = 0,
                 liveness_period_s: float = 0.2, request_timeout_s: float = 5.0, max_connections: int = 512,
                 replay_cap: int = 200_000) -> None:
        self.controller, self.token = controller, auth.check_token(token)
        self.request_timeout_s, self.max_connections = request_timeout_s, max_connections
        self.replay = auth.ReplayWindow(cap=replay_cap)
        self.refusals = RefusalLog(controller)
        self._active, self._active_lock = 0, threading.Lock()
        super().__init__((host, port), _Handler)
        self._stop = threading.Event()
        self._loops = [
            threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True),
            threading.Thread(target=self._watch, args=(liveness_period_s,), daemon=True),
        ]

    def __repr__(self) -> str:  # never the token
        return f"ControlServer({self.endpoint})"

    @property
    def endpoint(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> ControlServer:
        for t in self._loops:
            t.start()
        return self

    def process_request(self, request, client_address) -> None:
        with self._active_lock:
            full = self._active >= self.max_connections
            if not full:
                self._active += 1
        if full:
            self.refusals.refuse("connection", 503, f"connection from {client_address[0]} closed: "
                                                    f"{self.max_connections} connections already open")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()

    def _done(self) -> None:
        with self._active_lock:
            self._active -= 1

    def handle_error(self, request, client_address) -> None:  # a reset connection: no traceback on stderr
        log.debug("connection from %s failed", client_address[0], exc_info=True)

    def _watch(self, period: float) -> None:
        while not self._stop.wait(period):
            self.controller.check_liveness()
            self.refusals.flush()

    def stop(self) -> None:
        self._stop.set()
        self.shutdown()
        self.server_close()
        self.refusals.flush(force=True)


class ControlClient:
    """What agents, workers and operator tools use to talk to the controller.

    ``node``: the identity it signs with (see the module's docstring): a node's rank for its agent,
    workers and spares, :data:`hp.core.auth.OPERATOR` for operator tools. None: the payload's
    ``node_rank`` if it has one, else the operator."""

    def __init__(self, endpoint: str, token: str, timeout_s: float = 10.0, node: int | str | None = None,
                 follow: Callable[[str, float], str | None] | None = None) -> None:
        self.endpoint, self._timeout = endpoint, timeout_s
        self.node = None if node is None else str(node)
        # HA (hp.core.leader.LeaderResolver.wait_for_other): where the controller went when this endpoint
        # stops answering or answers that it was deposed; None: the endpoint is the only one
        self.follow = follow
        self._keys: dict[str, str] = {}
        self._token = token
        # The controller is reached directly: an http_proxy meant for package downloads must not apply.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __repr__(self) -> str:  # never the token
        return f"ControlClient({self.endpoint!r}, node={self.node!r})"

    def _key(self, node: str) -> str:
        if node not in self._keys:
            try:
                self._keys[node] = auth.node_key(self._token, node)
            except auth.AuthError as e:
                raise ControlPlaneError(f"cannot sign as {node!r}: {e}") from None
        return self._keys[node]

    def call(self, verb: str, payload: dict, timeout_s: float | None = None) -> dict:
        """Send one request; returns the answer or raises :class:`ControlPlaneError`. With ``follow``, a
        controller that does not answer, or was deposed, is replaced by the one ``follow`` names and the
        request sent again (same ``rid``: the new leader answers a request its predecessor decided with
        the same decision), until ``timeout_s`` (default: the client's) has passed."""
        timeout = self._timeout if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        payload = {**payload, "rid": secrets.token_hex(8)}
        while True:
            try:
                return self._send(verb, payload, max(0.05, deadline - time.monotonic()))
            except ControlPlaneError as e:
                if self.follow is None or e.status not in (0, 503):
                    raise
                other = self.follow(self.endpoint, deadline)
                if other is None:
                    raise
                log.info("controller at %s %s: following the leader to %s", self.endpoint,
                         "was deposed" if e.status else "does not answer", other)
                self.endpoint = other

    def _send(self, verb: str, payload: dict, timeout: float) -> dict:
        node = self.node
        if node is None:
            claimed = payload.get("node_rank")
            node = str(claimed) if type(claimed) is int else auth.OPERATOR
        key, nonce, path = self._key(node), secrets.token_hex(16), f"/v1/{verb}"
        body, signature = auth.encode_request(key, {**payload, "nonce": nonce}, method="POST", path=path)
        request = urllib.request.Request(
            f"http://{self.endpoint}{path}", data=body, method="POST",
            headers={"Content-Type": "application/json", auth.SIGNATURE_HEADER: signature, auth.NODE_HEADER: node},
        )
        try:
            try:
                with self._opener.open(request, timeout=timeout) as response:
                    status, raw, headers = response.status, response.read(), response.headers
            except urllib.error.HTTPError as e:
                status, raw, headers = e.code, e.read(), e.headers
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ControlPlaneError(f"controller at {self.endpoint} unreachable: {reason}") from None
        try:
            auth.verify_response(key, status, raw, nonce, headers.get(auth.RESPONSE_SIGNATURE_HEADER))
        except auth.AuthError:  # never act on it: its body is dropped
            if status == 401:
                raise ControlPlaneError(f"controller refused {verb}: unauthenticated (its answer is not signed with "
                                        f"{node!r}'s key either: wrong job token?)", status, {}) from None
            raise ControlPlaneError(f"answer {status} to {verb} from {self.endpoint} has a bad or missing response "
                                    "signature (forged, replayed, or not this job's controller): ignored",
                                    status, {}) from None
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise ControlPlaneError(f"controller answered {verb} with a body that is not a JSON object", status, {})
        if status != 200:
            raise ControlPlaneError(f"controller refused {verb}: {answer.get('error', status)}", status, answer)
        return answer


def request_finish(endpoint: str, token: str, reason: str) -> dict:
    """``hp finish``: ask the controller at ``endpoint`` (signed with the job token's operator key) to end the
    job after the next step every rank agrees on; its answer."""
    from hp.core.protocol import Verb

    return ControlClient(endpoint, token, node=auth.OPERATOR).call(Verb.FINISH, {"reason": reason})
