"""``nsa serve``: a Bokeh server over a store, opened read-only, safe by default.

It listens on 127.0.0.1 unless told otherwise; another address needs ``allow_remote`` AND a
token, which every request must carry (``?token=…`` once — it is then kept in a same-site
cookie, and the request is redirected to its address less the token, so that neither the
address bar nor the tab's back/forward history shows it — or the cookie), the page and its
websocket alike (Bokeh's ``AuthProvider`` hook; a websocket without it is refused with a 403
before its handshake, one whose Bokeh subprotocol header is malformed with a 400).  The token
never reaches a page's script: the cookie is HttpOnly, and the Bokeh session token embedded in
each page carries no cookie, no ``Cookie`` header and no ``?token=`` argument.  The store is
opened with ``SpectrumStore(url, mode="r")``: a read-only Zarr store, so no lease is taken and no
key can be written.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nsa_dist.errors import ServeError

if TYPE_CHECKING:
    from bokeh.server.server import Server

__all__ = ["ServeOptions", "make_server", "serve", "is_loopback", "TOKEN_ENV"]

TOKEN_ENV = "NSA_SERVE_TOKEN"
_COOKIE = "nsa_serve_token"


@dataclass(frozen=True)
class ServeOptions:
    """How ``nsa serve`` listens.

    Attributes:
        store: the store's path or URL (``s3://…``).
        host: the address to bind (default loopback only).
        port: the port (0: any free one; the URL printed says which).
        token: the secret every request must carry (required off loopback).
        allow_remote: consent to bind an address other people can reach.
        refresh_s: seconds between the pages' re-reads of the store.
    """

    store: str
    host: str = "127.0.0.1"
    port: int = 5006
    token: str | None = None
    allow_remote: bool = False
    refresh_s: float = 2.0

    def check(self) -> None:
        """ServeError unless the bind is loopback, or remote with consent and a token."""
        if self.refresh_s <= 0:
            raise ServeError(f"--refresh must be > 0 seconds, got {self.refresh_s}")
        if is_loopback(self.host):
            return
        if not self.allow_remote:
            raise ServeError(
                f"refusing to listen on {self.host!r}, which is not a loopback address: pass "
                f"--allow-remote and a --token (or ${TOKEN_ENV}) to serve the store to other machines"
            )
        if not self.token:
            raise ServeError(
                f"--allow-remote on {self.host!r} needs a --token (or ${TOKEN_ENV}): every request must carry it"
            )


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as exc:
        raise ServeError(f"cannot resolve the address {host!r} to listen on ({exc})") from exc
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _user_of(token: str | None) -> Callable[[Any], str | None]:
    """Who a request is (``"token"``, ``"viewer"`` when no token is needed), or None: not admitted.
    A request carrying ``?token=`` gets it as an HttpOnly, same-site cookie and a redirect to its
    address less the token."""
    from tornado.websocket import WebSocketHandler

    def get_user(handler: Any) -> str | None:
        if token is None:
            return "viewer"
        given = handler.get_argument("token", None)
        if given is not None and hmac.compare_digest(given.encode(), token.encode()):
            if not isinstance(handler, WebSocketHandler) and not getattr(handler, "_headers_written", False):
                # the token goes into the cookie and out of the address: the page is reached by a
                # redirect to its URL less ``token`` (not in the address bar, the tab's history
                # or any page script's ``location``)
                handler.set_cookie(_COOKIE, token, httponly=True, samesite="Strict")
                if handler.request.method in ("GET", "HEAD"):
                    handler.redirect(_without_token_arg(handler.request))
            return "token"
        cookie = handler.get_cookie(_COOKIE)
        if cookie is not None and hmac.compare_digest(cookie.encode(), token.encode()):
            return "token"
        return None

    return get_user


_LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")


def _host_ok(handler: Any, bound: str) -> bool:
    """Whether a request's Host header names this server (localhost, 127.0.0.1, [::1] or the bound
    host, at the server's port): with no token, a page of another site whose name was made to
    resolve to this machine (DNS rebinding) sends its own Host, and is refused."""
    host = (handler.request.headers.get("Host") or "").lower()
    try:
        port = handler.request.connection.stream.socket.getsockname()[1]
    except Exception:  # noqa: BLE001 — no socket to ask: the name alone
        port = None
    name, _, given = host.rpartition(":") if not host.endswith("]") else (host, "", "")
    if not name:
        name, given = host, ""
    names = {*_LOCAL_NAMES, bound.lower(), f"[{bound.lower()}]"}
    return name in names and (port is None or given in (str(port), "" if port == 80 else str(port)))


def _log_refused_host(handler: Any) -> None:
    import logging

    logging.getLogger("nsa_dist.serve").warning(
        "refused a request for %s with Host %r (not this server's name)",
        handler.request.path,
        handler.request.headers.get("Host", "")[:100],
    )


_REFUSED = "nsa serve: this server needs its token: open the page with ?token=TOKEN"


def _auth(token: str | None, bound: str = "127.0.0.1") -> Any:
    """A Bokeh AuthProvider admitting requests that carry ``token`` (query argument or cookie; every
    request when None), and refusing before its handshake a websocket whose Bokeh subprotocol
    header is not ``bokeh, <a valid session token>``."""
    from bokeh.server.auth_provider import AuthProvider
    from tornado.web import HTTPError, RequestHandler
    from tornado.websocket import WebSocketHandler

    class Refused(RequestHandler):
        def get(self) -> None:
            self.set_status(403)
            self.write(_REFUSED)

    get_user = _user_of(token)

    async def get_user_async(handler: RequestHandler) -> str | None:
        # Called before the handler's method, so before a websocket's handshake: a websocket without
        # the token is refused there with a 403, one with a malformed Bokeh subprotocol with a 400
        # (one access-log line each); refused after the upgrade, it was a failed handshake and a
        # traceback in the log per attempt.
        if token is None and not _host_ok(handler, bound):
            _log_refused_host(handler)
            raise HTTPError(403)
        if not _utf8_query(handler.request):  # a page's arguments are decoded as UTF-8: a 500 and two tracebacks
            raise HTTPError(400, reason="Query arguments must be UTF-8")
        user = get_user(handler)
        if isinstance(handler, WebSocketHandler):
            if user is None:
                raise HTTPError(403)
            why = bad_subprotocol(handler)
            if why:
                raise HTTPError(400, reason=f"Bad Bokeh websocket: {why}")
        return user

    class TokenAuth(AuthProvider):
        @property
        def get_user_async(self) -> Callable[[RequestHandler], Awaitable[str | None]]:
            return get_user_async

        @property
        def login_url(self) -> str:
            return "/refused"

        @property
        def login_handler(self) -> type[RequestHandler]:
            return Refused

    return TokenAuth()


def _utf8_query(request: Any) -> bool:
    """Whether every query argument's value of ``request`` is UTF-8 (``?name=%ff`` is not)."""
    try:
        for values in (request.arguments or {}).values():
            for v in values:
                v.decode("utf-8") if isinstance(v, bytes) else None
    except UnicodeDecodeError:
        return False
    return True


def _without_token_arg(request: Any) -> str:
    """The path and query of ``request`` less its ``token`` argument (a relative redirect)."""
    from urllib.parse import parse_qsl, urlencode

    args = [(k, v) for k, v in parse_qsl(request.query, keep_blank_values=True) if k != "token"]
    return request.path + (f"?{urlencode(args)}" if args else "")


def bad_subprotocol(handler: Any) -> str | None:
    """Why the websocket request of ``handler`` cannot open a Bokeh session (its
    ``Sec-WebSocket-Protocol`` must be ``bokeh, TOKEN`` with a readable, unexpired session token,
    signed when the server signs them), or None when it can: what Bokeh checks after the
    handshake, where a refusal is a traceback."""
    import calendar
    import datetime as dt

    from bokeh.util.token import check_token_signature, get_session_id, get_token_payload

    protocols = [p.strip() for p in handler.request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
    if len(protocols) != 2 or protocols[0] != "bokeh" or not protocols[1]:
        return "the subprotocol header is not 'bokeh, TOKEN'"
    tok = protocols[1]
    try:
        session_id = get_session_id(tok)
        payload = get_token_payload(tok)
    except Exception:  # noqa: BLE001 — any undecodable token is the same refusal
        return "unreadable session token"
    if not isinstance(session_id, str) or not session_id:
        return "no session id in the token"
    expiry = payload.get("session_expiry")
    if not isinstance(expiry, (int, float)):
        return "no session expiry in the token"
    if calendar.timegm(dt.datetime.now(tz=dt.timezone.utc).timetuple()) >= expiry:
        return "expired session token (reload the page)"
    app = handler.application
    if not check_token_signature(tok, signed=app.sign_sessions, secret_key=app.secret_key):
        return "bad session token signature"
    return None


def _application(application: type) -> type:
    """``application`` (Bokeh's ``Application``) whose pages are built off the event loop, and
    whose sessions' tokens carry the request's query arguments less ``token`` (the session token is
    readable by the page's script)."""

    class App(application):  # type: ignore[misc, valid-type]
        def __init__(self, handler: Any, build: Callable[[dict[str, str]], Any]) -> None:
            super().__init__(handler)
            self._build = build

        def process_request(self, request: Any) -> dict[str, Any]:
            args = {k: v for k, v in (request.arguments or {}).items() if k != "token"}
            return {**super().process_request(request), "arguments": args}

        async def on_session_created(self, session_context: Any) -> None:
            # The page's store reads and models, in a worker thread: the loop serves the other
            # sessions meanwhile; the app function then only attaches the result.
            import asyncio

            from nsa_dist.serve._live import request_args

            await super().on_session_created(session_context)
            args = request_args(session_context)
            session_context._nsa_attach = await asyncio.get_running_loop().run_in_executor(None, self._build, args)

    return App


def _run_handlers(pages: Any, token: str | None, refresh_s: float, bound: str = "127.0.0.1") -> list[tuple[str, type]]:
    """The Tornado handlers of ``/run`` (the page) and ``/run/data`` (its figures and header, as
    JSON, read and built in a worker thread), admitting what the Bokeh pages admit."""
    import asyncio
    import html
    import json
    import logging

    from tornado.web import HTTPError, RequestHandler

    from nsa_dist.serve.run_page import page_html, parse_choices

    get_user = _user_of(token)
    page = page_html(refresh_s)

    class Guarded(RequestHandler):
        def set_default_headers(self) -> None:
            self.set_header("Cache-Control", "no-store")
            self.set_header("X-Content-Type-Options", "nosniff")

        def prepare(self) -> None:
            if token is None and not _host_ok(self, bound):
                _log_refused_host(self)
                self.set_status(403)
                self.finish("nsa serve: refused: this server is not reached by that name")
                return
            if get_user(self) is None:
                self.set_status(403)
                self.finish(_REFUSED)
                return
            if not _utf8_query(self.request):  # as the Bokeh pages (their arguments are decoded as UTF-8)
                self.set_status(400)
                self.finish("nsa serve: query arguments must be UTF-8")

    class RunPage(Guarded):
        def get(self) -> None:
            self.set_header("Content-Type", "text/html; charset=utf-8")
            self.finish(page)

    class RunData(Guarded):
        def prepare(self) -> None:
            super().prepare()
            if not self._finished and self.request.headers.get("Sec-Fetch-Site", "") == "cross-site":
                # a page of another site may link to a run's page, never read its data (the
                # browser's own CORS rules hold too; this refuses before any store read)
                self.set_status(403)
                self.finish("nsa serve: refused: a cross-site request for a run's data")

        async def get(self) -> None:
            arg = self.get_argument("id", "")
            try:
                tab = int(self.get_argument("tab", "0"))
            except ValueError:
                tab = 0
            try:
                choices = parse_choices(self.get_argument("c", ""))
            except ValueError as exc:
                raise HTTPError(400, reason="Bad widget choices") from exc
            have = self.get_argument("have", "")[:64]
            try:
                body = await asyncio.get_running_loop().run_in_executor(None, pages.answer, arg, tab, choices, have)
            except Exception as exc:  # noqa: BLE001 — one line in the log, a message on the page
                log = logging.getLogger("nsa_dist.serve")
                log.warning("/run/data?id=%.80s: %s: %.300s", arg, type(exc).__name__, exc)
                why = html.escape(f"{type(exc).__name__}: {exc}")
                body = json.dumps({"message": f"<p><b>nsa serve cannot show this page:</b> {why}</p>"}).encode()
            self.set_header("Content-Type", "application/json; charset=utf-8")
            self.finish(body)

    return [(r"/run", RunPage), (r"/run/data", RunData)]


class _ClosedPageFilter:
    """Drops Bokeh's warning for an update sent to a page that had just been closed (one line per
    websocket frame in flight when a viewer leaves: noise, not a fault)."""

    def filter(self, record: Any) -> bool:
        return "connection was closed" not in record.getMessage()


class _TokenLogFilter:
    """Writes ``token=…`` in access-log lines (a refused or mistyped URL's) as ``token=…``."""

    def filter(self, record: Any) -> bool:
        if isinstance(record.args, tuple) and any("token=" in str(a) for a in record.args):
            record.args = tuple(_TOKEN_ARG.sub(r"\1…", a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str) and "token=" in record.msg:
            record.msg = _TOKEN_ARG.sub(r"\1…", record.msg)
        return True


_TOKEN_ARG = re.compile(r"(token=)[^&\s#]*")


def _quiet_closed_pages() -> None:
    import logging

    log = logging.getLogger("bokeh.server.views.ws")
    if not any(isinstance(f, _ClosedPageFilter) for f in log.filters):
        log.addFilter(_ClosedPageFilter())
    access = logging.getLogger("tornado.access")
    if not any(isinstance(f, _TokenLogFilter) for f in access.filters):
        access.addFilter(_TokenLogFilter())


def make_server(opts: ServeOptions, **server_kw: Any) -> Server:
    """The Bokeh server of ``opts`` (bound, not started): ``/`` the run table, ``/run?id=RUN`` a
    run's page, ``/sweep?name=NAME`` a sweep's figures.  ``server_kw``: more arguments of Bokeh's
    ``Server`` (e.g. ``unused_session_lifetime_milliseconds``: how long a closed page's session
    lives on).

    Raises:
        ServeError: an unsafe bind (see :meth:`ServeOptions.check`) or a port that cannot be bound.
        StoreError: no store at ``opts.store``.
        MissingDependencyError: bokeh is not installed.
    """
    opts.check()
    from nsa_dist._extras import require

    require("bokeh", "serve", "nsa serve")
    from bokeh.application import Application
    from bokeh.application.handlers.function import FunctionHandler
    from bokeh.server.server import Server

    from nsa_dist.serve._live import Shared
    from nsa_dist.serve.run_page import RunPages
    from nsa_dist.serve.sweep_page import sweep_page
    from nsa_dist.serve.table import table_page
    from nsa_dist.store import SpectrumStore

    store = SpectrumStore(opts.store, mode="r")
    shared = Shared()  # one read per refresh for every session (see nsa_dist.serve._live)
    apps = {
        "/": table_page(store, opts.refresh_s, shared),
        "/sweep": sweep_page(store, opts.refresh_s, shared),
    }
    # A page's script sees its Bokeh session token, and the token carries the request's headers,
    # cookies and query arguments: none of them may carry the serve token (the cookie is HttpOnly).
    kw: dict[str, Any] = {"include_cookies": [], "exclude_headers": ["Cookie", "Authorization"], **server_kw}
    kw["auth_provider"] = _auth(opts.token, opts.host)
    # A run's page is static HTML and its figures one JSON per state of the run, shared by its
    # viewers (see nsa_dist.serve.run_page.RunPages), not a Bokeh session per viewer.
    kw["extra_patterns"] = [
        *kw.get("extra_patterns", []),
        *_run_handlers(pages := RunPages(store, opts.refresh_s, shared), opts.token, opts.refresh_s, opts.host),
    ]
    if not is_loopback(opts.host):
        kw["allow_websocket_origin"] = ["*"]  # any name of this host; the token (same-site cookie) admits
    try:
        server = Server(
            {path: _application(Application)(FunctionHandler(fn), fn.build) for path, fn in apps.items()},
            address=opts.host,
            port=opts.port,
            num_procs=1,
            **kw,
        )
    except OSError as exc:
        raise ServeError(f"cannot listen on {opts.host}:{opts.port} ({exc.strerror or exc})") from exc
    _quiet_closed_pages()
    server.nsa_shared = shared  # type: ignore[attr-defined]  (the tests count its reads)
    server.nsa_pages = pages  # type: ignore[attr-defined]  (the tests count its builds)
    return server


def serve(opts: ServeOptions, announce: Callable[[str], None] = print) -> None:
    """Serve until interrupted; ``announce`` gets the URL to open (with the token, if any)."""
    server = make_server(opts)
    host = f"[{opts.host}]" if ":" in opts.host else opts.host
    url = f"http://{host}:{server.port}/" + (f"?token={opts.token}" if opts.token else "")
    server.start()
    announce(url)
    caught: list[int] = []
    restore = _stop_on_signals(server.io_loop, caught)
    try:
        server.io_loop.start()
    finally:
        restore()
        server.stop()
    for signum in caught[:1]:  # the caller's own handling (Ctrl-C, SIGTERM), now outside the loop
        signal.raise_signal(signum)


def _stop_on_signals(io_loop: Any, caught: list[int]) -> Callable[[], None]:
    """SIGINT and SIGTERM stop ``io_loop`` from the loop itself (an exception raised by a signal
    handler can land in a callback whose errors are ignored — a weakref's — and leave the server
    running); they are noted in ``caught`` and the previous handlers come back with the returned call.
    Outside the main thread nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: object) -> None:
        caught.append(signum)
        io_loop.asyncio_loop.call_soon_threadsafe(io_loop.stop)  # wakes the loop through its self-pipe

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, h in previous.items():
            signal.signal(sig, signal.SIG_DFL if h is None else h)

    return restore
