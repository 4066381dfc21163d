"""The console's web shell (Starlette + Jinja2, served by uvicorn): routes, login, CSRF,
security headers. Pages are rendered on the server; the only JavaScript (``static/console.js``,
no inline script: the CSP allows none) refreshes the cluster table and asks for confirmation
before a Cancel or a purge.

Security (docs/console.md, "Security"):
- a secure cluster (TLS files given): every page but ``/login`` needs a session made by
  logging in with a cluster token; calls go out with that token, so the nodes decide what
  the viewer may do (a refusal is shown, never hidden);
- an open cluster: no login, and every page says so in a banner;
- every POST carries the session's CSRF token (a hidden field) and is refused without it;
  the session cookie is HttpOnly, SameSite=Strict, and Secure when served over HTTPS.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import quote, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from cluster import errors as E
from cluster.codec import subject_problem
from cluster.console import views
from cluster.console.backend import ConsoleCluster, Viewers
from cluster.console.sessions import Session, Sessions, csrf_ok

COOKIE = "hourglass_console"
GUESTS_MAX = 2000            # sessions without a login (see create_app)
TOKEN_CHARS_MAX = 4096      # a token typed into the login form
ID_CHARS_MAX = 1024          # a message id typed into the page (the wire allows less; the node says so)
SELECTED_MAX = 500           # dead letters in one send-back or purge
PAGE_REFRESH_MS = 5000       # the cluster and subjects pages' self-refresh
SAMPLES_MAX = 1000           # real-time masters whose last counters are kept for rates
TEMPLATES = Path(__file__).parent / "templates"
STATIC = Path(__file__).parent / "static"


def local_path(target: str) -> bool:
    """Whether a ``next`` target stays on this console: a path, never another host
    (``//host``, ``/\\host`` and ``http:`` lead away)."""
    return target.startswith("/") and not target.startswith(("//", "/\\")) and "\\" not in target \
        and not any(c < " " for c in target)


def _now_ms() -> int:
    return int(time.time() * 1000)


def create_app(cluster: ConsoleCluster, *, https: bool = False) -> Starlette:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]))
    env.globals.update(iso=views.iso, secure=cluster.secure, refresh_ms=PAGE_REFRESH_MS)
    # two pools: sessions made for anyone who asks a page (guests: the login form's CSRF token,
    # an open cluster's viewers) and logged-in ones, so that a stream of new guests can push
    # out only guests, never a logged-in viewer
    guests = Sessions(sessions_max=GUESTS_MAX)
    sessions = Sessions()
    viewers = Viewers(cluster)
    epochs = views.EpochHistory()  # per group, for "master changes in the last hour"

    def session_of(request: Request) -> Session | None:
        sid = request.cookies.get(COOKIE)
        return sessions.get(sid, _now_ms()) or guests.get(sid, _now_ms())

    def set_cookie(resp: Response, s: Session) -> Response:
        resp.set_cookie(COOKIE, s.sid, httponly=True, samesite="strict", secure=https, path="/")
        return resp

    def render(request: Request, name: str, s: Session, status_code: int = 200, **ctx) -> HTMLResponse:
        flash, s.flash = s.flash, []
        html = env.get_template(name).render(request=request, csrf=s.csrf, flash=flash,
                                             logged_in=s.token is not None, page=name.removesuffix(".html"), **ctx)
        return set_cookie(HTMLResponse(html, status_code=status_code), s)

    def viewer_session(request: Request) -> Session | Response:
        """The viewer's session; a secure cluster sends one without a login to ``/login``."""
        s = session_of(request)
        if cluster.secure and (s is None or s.token is None):
            here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse("/login?" + urlencode({"next": here}), status_code=303)
        return s if s is not None else guests.create(_now_ms())

    async def checked_form(request: Request, s: Session | None) -> dict | Response:
        form = await request.form()
        if not csrf_ok(s, form.get("csrf")):
            return PlainTextResponse("refused: the form's CSRF token is missing or wrong; reload the page",
                                     status_code=403)
        return form

    def viewer_page(handler: Callable[[Request, Session], Awaitable[Response]]
                    ) -> Callable[[Request], Awaitable[Response]]:
        """A page for the viewer: ``handler(request, s)`` runs with the viewer's session
        (``viewer_session``: a secure cluster sends a viewer without a login to ``/login``)."""
        @functools.wraps(handler)
        async def page(request: Request) -> Response:
            s = viewer_session(request)
            if isinstance(s, Response):
                return s
            return await handler(request, s)
        return page

    def viewer_post(handler: Callable[[Request, Session, dict], Awaitable[Response]]
                    ) -> Callable[[Request], Awaitable[Response]]:
        """A form the viewer posts: ``handler(request, s, form)`` runs once the session is there
        and the form carries its CSRF token (``checked_form``)."""
        @functools.wraps(handler)
        async def post(request: Request) -> Response:
            s = viewer_session(request)
            if isinstance(s, Response):
                return s
            form = await checked_form(request, s)
            if isinstance(form, Response):
                return form
            return await handler(request, s, form)
        return post

    # ------------------------------------------------------------------ login

    async def login(request: Request) -> Response:
        if request.method == "GET":
            s = session_of(request) or guests.create(_now_ms())
            return render(request, "login.html", s, next=request.query_params.get("next", "/"))
        s = session_of(request)
        form = await checked_form(request, s)  # no session: refused (csrf_ok)
        if isinstance(form, Response):
            return form
        token = str(form.get("token", "")).strip()[:TOKEN_CHARS_MAX]
        nxt = str(form.get("next", "/"))
        if not token:
            s.flash.append("give a token")
            return RedirectResponse("/login?" + urlencode({"next": nxt}), status_code=303)
        try:  # the meta servers answer any valid token (discover): a wrong one is refused here, not on every page
            await (await viewers.get(token)).resolver.load()
        except E.Unauthenticated as e:
            await viewers.drop(token)
            s.flash.append(f"log in refused: {e}")
            return RedirectResponse("/login?" + urlencode({"next": nxt}), status_code=303)
        except E.HourglassError as e:  # the cluster cannot say now: let the viewer in, the pages say why
            s.flash.append(f"the cluster could not check the token now: {e}")
        guests.drop(s.sid)
        sessions.drop(s.sid)
        fresh = sessions.create(_now_ms(), token)  # a new id at login
        fresh.flash, s.flash = s.flash, []
        return set_cookie(RedirectResponse(nxt if local_path(nxt) else "/", status_code=303), fresh)

    async def logout(request: Request) -> Response:
        s = session_of(request)
        form = await request.form()
        if not csrf_ok(s, form.get("csrf")):
            return PlainTextResponse("refused: CSRF token missing or wrong", status_code=403)
        sessions.drop(s.sid)
        guests.drop(s.sid)
        return RedirectResponse("/login" if cluster.secure else "/", status_code=303)

    # ------------------------------------------------------------------ pages

    @viewer_page
    async def cluster_page(request: Request, s: Session) -> Response:
        error, groups = None, []
        try:
            groups = views.cluster_groups(await (await viewers.get(s.token)).status_rows(), epochs, _now_ms())
        except E.HourglassError as e:
            error = str(e)
        name = "cluster_table.html" if request.query_params.get("fragment") else "cluster.html"
        return render(request, name, s, groups=groups, error=error, now_ms=_now_ms())

    @viewer_page
    async def schedule_page(request: Request, s: Session) -> Response:
        error, rows, by_group, missing = None, [], {}, []
        subject = request.query_params.get("subject", "")
        if subject and subject_problem(subject):
            error, subject = f"subject {subject[:200]!r}: {subject_problem(subject)}", ""
        try:
            rows = await (await viewers.get(s.token)).status_rows(subject)
        except E.HourglassError as e:
            error = str(e)
        totals, minutes, lateness = {}, {}, {}
        for r in rows:
            if r.get("role") != "delay" or "error" in r or r.get("mode", "master") != "master":
                continue
            g = r.get("group", "?")
            totals[g] = r.get("pending", 0)
            lateness[g] = views.lateness_text(r)
            got = views.pending_buckets(r)
            if got is not None and subject:  # the subject's counts, in the same buckets
                one = views.subject_buckets(r, subject)
                got = None if one is None else (one, got[1])
                totals[g] = sum(one.values()) if one is not None else "not reported"
            if got is None:
                missing.append(g)
            else:
                by_group[g] = got
            m = views.subject_minutes(r, subject) if subject else views.pending_minutes(r)
            if m is not None:
                minutes[g] = m
        now = _now_ms()
        subjects, other = views.subject_totals([r for r in rows if r.get("role") == "delay" and "error" not in r
                                                and r.get("mode", "master") == "master"])
        return render(request, "schedule.html", s, error=error, totals=totals, missing=missing, lateness=lateness,
                      schedule=views.schedule_views(by_group, now, minutes) if by_group else [], now_ms=now,
                      subject=subject, subjects=subjects, other_subjects=other)

    samples: dict[str, tuple[int, dict]] = {}  # real-time master address -> its last (now_ms, counters)

    @viewer_page
    async def subjects_page(request: Request, s: Session) -> Response:
        error, flows, consumers, missing = None, [], [], []
        try:
            rows = await (await viewers.get(s.token)).status_rows()
        except E.HourglassError as e:
            error, rows = str(e), []
        for r in rows:
            if r.get("role") != "realtime" or "error" in r or r.get("mode", "master") != "master":
                continue
            addr = r.get("address", "?")
            flows.append(views.node_flow(r, samples.get(addr)))
            got = views.consumer_rows(r)
            if got is None:
                missing.append(r.get("group", "?"))
            else:
                consumers += got
            if len(samples) >= SAMPLES_MAX and addr not in samples:
                samples.pop(next(iter(samples)))
            samples[addr] = (int(r.get("now_ms") or 0), dict(r.get("counters") or {}))
        return render(request, "subjects.html", s, flows=flows, consumers=consumers, missing=missing, error=error)

    @viewer_page
    async def message_page(request: Request, s: Session) -> Response:
        msg_id = request.query_params.get("id", "").strip()[:ID_CHARS_MAX]
        found, hops, error = None, [], None
        if msg_id:
            try:
                found = await (await viewers.get(s.token)).trace(msg_id)
                hops = views.trace(found, _now_ms())
            except E.HourglassError as e:
                error = f"{type(e).__name__}: {e}"
        return render(request, "message.html", s, msg_id=msg_id, found=found, hops=hops, error=error,
                      cancellable=found is not None and views.cancellable(found),
                      status_code=404 if isinstance(error, str) and error.startswith("NotFound") else 200)

    @viewer_post
    async def cancel(request: Request, s: Session, form: dict) -> Response:
        msg_id = str(form.get("id", "")).strip()[:ID_CHARS_MAX]
        try:
            r = await (await viewers.get(s.token)).cancel(msg_id)
            s.flash.append(f"cancelled {msg_id} (seq {r['seq']})")
        except E.HourglassError as e:
            s.flash.append(f"cancel refused: {type(e).__name__}: {e}")
        return RedirectResponse(f"/message?id={quote(msg_id)}", status_code=303)

    @viewer_page
    async def dead_page(request: Request, s: Session) -> Response:
        letters, error = [], None
        try:
            letters = await (await viewers.get(s.token)).dead_letters()
        except E.HourglassError as e:
            error = f"{type(e).__name__}: {e}"
        return render(request, "dead.html", s, letters=letters, error=error)

    @viewer_post
    async def dead_action(request: Request, s: Session, form: dict) -> Response:
        picked = [str(v) for v in form.getlist("pick")][:SELECTED_MAX]
        v = await viewers.get(s.token)
        try:
            if form.get("action") == "purge":
                s.flash.append(f"purged {await v.purge(picked)} dead letter(s)")
            else:
                s.flash.append(f"sent {await v.send_back(picked)} dead letter(s) back to their subject")
        except E.HourglassError as e:
            s.flash.append(f"refused: {type(e).__name__}: {e}")
        return RedirectResponse("/dead-letters", status_code=303)

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await viewers.close()

    routes = [
        Route("/", cluster_page), Route("/cluster", cluster_page),
        Route("/schedule", schedule_page), Route("/subjects", subjects_page),
        Route("/message", message_page), Route("/message/cancel", cancel, methods=["POST"]),
        Route("/dead-letters", dead_page), Route("/dead-letters", dead_action, methods=["POST"]),
        Route("/login", login, methods=["GET", "POST"]), Route("/logout", logout, methods=["POST"]),
        Route("/healthz", health),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(SecurityHeaders)])


SECURITY_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"content-security-policy", b"default-src 'self'; style-src 'self' 'unsafe-inline'; "
                                 b"script-src 'self'; frame-ancestors 'none'; form-action 'self'"),
    (b"cache-control", b"no-store"),
]


class SecurityHeaders:
    """ASGI middleware: the headers of ``SECURITY_HEADERS`` on every response (no framing,
    no sniffing, scripts and forms only from the console itself, nothing cached)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                message = {**message, "headers": list(message.get("headers", []))
                           + [(k, v) for k, v in SECURITY_HEADERS if k not in have]}
            await send(message)
        await self.app(scope, receive, send_with_headers)
