"""``nsa serve``: a Bokeh server over a store, opened read-only, safe by default.

It listens on 127.0.0.1 unless told otherwise; another address needs ``allow_remote`` AND a
token, which every request must carry (``?token=…`` once — it is then kept in a same-site cookie —
or the cookie), the page and its websocket alike (Bokeh's ``AuthProvider`` hook; a websocket
without it is refused with a 403 before its handshake).  The token never reaches a page's script:
the cookie is HttpOnly, and the Bokeh session token embedded in each page carries no cookie, no
``Cookie`` header and no ``?token=`` argument.  The store is
opened with ``SpectrumStore(url, mode="r")``: a read-only Zarr store, so no lease is taken and no
key can be written.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
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
            raise ServeError(f"refusing to listen on {self.host!r}, which is not a loopback address: pass "
                             f"--allow-remote and a --token (or ${TOKEN_ENV}) to serve the store to other machines")
        if not self.token:
            raise ServeError(f"--allow-remote on {self.host!r} needs a --token (or ${TOKEN_ENV}): every request "
                             "must carry it")


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


def _auth(token: str) -> Any:
    """A Bokeh AuthProvider admitting requests that carry ``token`` (query argument or cookie)."""
    from bokeh.server.auth_provider import AuthProvider
    from tornado.web import HTTPError, RequestHandler
    from tornado.websocket import WebSocketHandler

    class Refused(RequestHandler):
        def get(self) -> None:
            self.set_status(403)
            self.write("nsa serve: this server needs its token: open the page with ?token=TOKEN")

    def get_user(handler: RequestHandler) -> str | None:
        given = handler.get_argument("token", None)
        if given is not None and hmac.compare_digest(given.encode(), token.encode()):
            if hasattr(handler, "set_cookie") and not getattr(handler, "_headers_written", False):
                try:
                    handler.set_cookie(_COOKIE, token, httponly=True, samesite="Strict")
                except Exception:  # noqa: BLE001 — a websocket handshake sets no cookie: the page did
                    pass
            return "token"
        cookie = handler.get_cookie(_COOKIE)
        if cookie is not None and hmac.compare_digest(cookie.encode(), token.encode()):
            return "token"
        return None

    async def get_user_async(handler: RequestHandler) -> str | None:
        # Called before the handler's method, so before a websocket's handshake: a websocket without
        # the token is refused there with a 403 (one access-log line); refused after the upgrade, it
        # was a failed handshake and a traceback in the log per attempt.
        user = get_user(handler)
        if user is None and isinstance(handler, WebSocketHandler):
            raise HTTPError(403)
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


def _without_token(application: type) -> type:
    """``application`` (Bokeh's ``Application``) whose sessions' tokens carry the request's query
    arguments less ``token``: the session token is readable by the page's script."""

    class WithoutToken(application):  # type: ignore[misc, valid-type]
        def process_request(self, request: Any) -> dict[str, Any]:
            args = {k: v for k, v in (request.arguments or {}).items() if k != "token"}
            return {**super().process_request(request), "arguments": args}

    return WithoutToken


def make_server(opts: ServeOptions) -> Server:
    """The Bokeh server of ``opts`` (bound, not started): ``/`` the run table, ``/run?id=RUN`` a
    run's page, ``/sweep?name=NAME`` a sweep's figures.

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

    from nsa_dist.serve.run_page import run_page
    from nsa_dist.serve.sweep_page import sweep_page
    from nsa_dist.serve.table import table_page
    from nsa_dist.store import SpectrumStore

    store = SpectrumStore(opts.store, mode="r")
    apps = {"/": table_page(store, opts.refresh_s), "/run": run_page(store, opts.refresh_s),
            "/sweep": sweep_page(store, opts.refresh_s)}
    # A page's script sees its Bokeh session token, and the token carries the request's headers,
    # cookies and query arguments: none of them may carry the serve token (the cookie is HttpOnly).
    kw: dict[str, Any] = {"include_cookies": [], "exclude_headers": ["Cookie", "Authorization"]}
    if opts.token:
        kw["auth_provider"] = _auth(opts.token)
    if not is_loopback(opts.host):
        kw["allow_websocket_origin"] = ["*"]  # any name of this host; the token (same-site cookie) admits
    try:
        return Server({path: _without_token(Application)(FunctionHandler(fn)) for path, fn in apps.items()},
                      address=opts.host, port=opts.port, num_procs=1, **kw)
    except OSError as exc:
        raise ServeError(f"cannot listen on {opts.host}:{opts.port} ({exc.strerror or exc})") from exc


def serve(opts: ServeOptions, announce: Callable[[str], None] = print) -> None:
    """Serve until interrupted; ``announce`` gets the URL to open (with the token, if any)."""
    server = make_server(opts)
    host = f"[{opts.host}]" if ":" in opts.host else opts.host
    url = f"http://{host}:{server.port}/" + (f"?token={opts.token}" if opts.token else "")
    server.start()
    announce(url)
    try:
        server.io_loop.start()
    finally:
        server.stop()
