"""The dashboard's aiohttp application, on the coordinator's own event loop.

Handlers are thin: they read the core (on the loop, with no await between the reads of one answer, so
they see one consistent state), take a snapshot, and render it. Rendering a job's fragment and planning
a pasted job file run on a worker thread, as the gRPC PlanJob does; errors map as the servicer maps them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from importlib import resources
from typing import Any, Awaitable, Callable

import structlog
from aiohttp import web

from rankctl.contract.jobfile import SpecError
from rankctl.contract.limits import MAX_JOB_FILE_BYTES
from rankctl.coordinator.logs.logfetch import get_logs
from rankctl.coordinator.api.servicer import domain_status
from rankctl.coordinator.store.database import StoreError
from rankctl.coordinator.web import jobview, views
from rankctl.coordinator.web.access import ANY_CERT, WHO, guarded
from rankctl.coordinator.web.grid import rank_grid, window
from rankctl.coordinator.web.html import page
from rankctl.coordinator.web.layouts import Layouts
from rankctl.coordinator.web.series import SeriesCache, snapshot
from rankctl.proto import rankctl_pb2 as pb

log = structlog.get_logger("rankctl.coordinator")
LOG_TIMEOUT_S = 15.0
STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
HTTP_OF_GRPC = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "FAILED_PRECONDITION": 409, "ALREADY_EXISTS": 409}


MAX_QUERY_INT = 2**31 - 1   # page numbers, cursors and ranks are int32 on the wire
MAX_JOB_ID = 128            # longer path ids are no job's


def _int(request: web.Request, name: str, default: int, high: int = MAX_QUERY_INT) -> int:
    """Query parameter ``name`` as a whole number in 0..high (``default`` when absent); 400 naming it otherwise."""
    text = request.query.get(name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 10 and int(text) <= high):
        raise web.HTTPBadRequest(text=f"query parameter {name}={_shown(text)} must be a whole number from 0 to {high}")
    return int(text)


def _job_id(request: web.Request) -> str:
    job_id = request.match_info["job_id"]
    if len(job_id) > MAX_JOB_ID or not job_id.isprintable():
        raise web.HTTPBadRequest(text=f"job id {_shown(job_id)} must be at most {MAX_JOB_ID} printable characters")
    return job_id


def _shown(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _html(body: str, status: int = 200) -> web.Response:
    return web.Response(text=body, status=status, content_type="text/html")


def http_error(exc: Exception) -> web.Response:
    """The HTTP answer to a domain error, with the message a gRPC client would get (``servicer.domain_status``)."""
    known = domain_status(exc)
    if known is not None:
        code, text = known
        return web.Response(text=text, status=503 if isinstance(exc, StoreError) else HTTP_OF_GRPC.get(code.name, 400))
    log.exception("http.internal_error")
    return web.Response(text=f"internal error ({type(exc).__name__}); see the coordinator log", status=500)


def _answers(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):  # noqa: ANN202
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 - every other error is answered, never a traceback
            return http_error(exc)
    return wrapped


class Dashboard:
    """The pages over one core; per-job caches (step series, layouts) shared by every viewer."""

    def __init__(self, core: Any, metrics_per_rank: bool = False) -> None:
        self.core, self.metrics_per_rank = core, metrics_per_rank
        self.series = SeriesCache(lambda job_id, after, limit: core.events(job_id, after, limit, ranks=False))
        self.layouts = Layouts()
        self._metrics: Any = None
        self._static = {name: (resources.files(__package__) / "static" / name).read_bytes() for name in STATIC}

    def _who(self, request: web.Request) -> str:
        who = request.get(WHO)
        return str(who) if who is not None else ""

    async def jobs(self, request: web.Request) -> web.StreamResponse:
        jobs, cursor = self.core.book.page(views.JOBS_PAGE, _int(request, "before", 0))
        layouts = await self.layouts.of(jobs)
        return _html(page("jobs", views.jobs_table(jobs, layouts, cursor, time.time()), self._who(request)))

    async def _fragment(self, job_id: str, node_page: int) -> tuple[str, dict]:
        """The live fragment and the JSON data of a job, read at one moment, rendered on a worker thread."""
        job = self.core.get(job_id)
        cfg = (await self.layouts.of([job]))[job.id]
        win = window(job.world_size, job.slots_per_node, node_page)
        shown = self.core.shown.job(job.id, *win.ranks)   # from here to the render: no await, one state
        job, summary, records, attempts, reason = shown.job, shown.summary, shown.ranks, shown.attempts, shown.reason
        series = snapshot(self.series.get(job.id))

        def render() -> tuple[str, dict]:
            grid = rank_grid(job, cfg, records, summary, win)
            html = jobview.live_fragment(job, summary, series, grid, attempts, reason, time.time())
            return html, jobview.job_data(job, summary, series)
        return await asyncio.to_thread(render)

    async def job(self, request: web.Request) -> web.StreamResponse:
        fragment, data = await self._fragment(_job_id(request), _int(request, "page", 0))
        job = self.core.get(data["id"])
        return _html(jobview.job_page(job, fragment, self._who(request), time.time()))

    async def live(self, request: web.Request) -> web.StreamResponse:
        fragment, _ = await self._fragment(_job_id(request), _int(request, "page", 0))
        return _html(fragment)

    async def data(self, request: web.Request) -> web.StreamResponse:
        _, data = await self._fragment(_job_id(request), _int(request, "page", 0))
        return web.json_response(data)

    async def logs(self, request: web.Request) -> web.StreamResponse:
        job = self.core.get(_job_id(request))
        if "rank" not in request.query:
            raise web.HTTPBadRequest(text=f"query parameter rank is required: 0 to {job.world_size - 1}")
        rank = _int(request, "rank", 0)  # get_logs says when it is not a rank of the job
        req = pb.GetLogsRequest(job_id=job.id, rank=rank, tail=jobview.LOG_TAIL)
        lines: list[str] = []

        async def read() -> None:
            async for line in get_logs(self.core, req):
                lines.append(line.line)
        try:
            await asyncio.wait_for(read(), LOG_TIMEOUT_S)
        except asyncio.TimeoutError:
            lines.append(f"[rankctl: the log of rank {rank} was not read within {LOG_TIMEOUT_S:g} s]")
        return web.Response(text=jobview.log_text(rank, lines[-jobview.LOG_TAIL * 2:]))

    async def nodes(self, request: web.Request) -> web.StreamResponse:
        body = views.nodes_table(self.core.shown.nodes(), _int(request, "page", 0), time.time())
        return _html(page("nodes", body, self._who(request)))

    async def plan_form(self, request: web.Request) -> web.StreamResponse:
        return _html(page("plan", views.plan_form(), self._who(request)))

    async def plan(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        text, sets = str(form.get("spec", "")), str(form.get("set", ""))
        overrides = [line.strip() for line in sets.splitlines() if line.strip()]

        def run() -> str:
            doc, spec = self.core.plan(text, overrides, "pasted job file")  # PlanJob's call: pure, any thread
            return views.plan_result(doc, spec)
        try:
            result, status = await asyncio.to_thread(run), 200
        except SpecError as exc:
            result, status = views.plan_errors(list(exc.errors)), 400
        return _html(page("plan", views.plan_form(text, sets) + result, self._who(request)), status)

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        if self._metrics is None:
            try:
                from rankctl.coordinator.web.metrics import CoordinatorMetrics
            except ImportError:
                return web.Response(text="metrics not available", status=503)
            self._metrics = CoordinatorMetrics(self.core, per_rank=self.metrics_per_rank)
        body, content_type = self._metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        return web.Response(body=self._static[name], content_type=STATIC[name],
                            headers={"Cache-Control": "max-age=300"})


# Defence in depth under the escaping of every shown value: only our own script runs, nothing is framed.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@web.middleware
async def _security_headers(request: web.Request, handler):  # noqa: ANN001, ANN202 - aiohttp's signature
    response = await handler(request)
    response.headers.update(SECURITY_HEADERS)
    return response


def build_app(dash: Dashboard, tls: bool, revocations: Any = None) -> web.Application:
    """Every route, behind the role of the ClientService method it mirrors (``access``); with ``revocations``
    (``security.revocation.Revocations``) a revoked client certificate is refused."""
    app = web.Application(client_max_size=4 * MAX_JOB_FILE_BYTES, middlewares=[_security_headers])
    routes = [
        ("GET", "/", dash.jobs, "ListJobs"),
        ("GET", "/jobs/{job_id}", dash.job, "GetJob"),
        ("GET", "/jobs/{job_id}/live", dash.live, "GetJob"),
        ("GET", "/jobs/{job_id}/data.json", dash.data, "GetJob"),
        ("GET", "/jobs/{job_id}/logs", dash.logs, "GetLogs"),
        ("GET", "/nodes", dash.nodes, "ListNodes"),
        ("GET", "/plan", dash.plan_form, "PlanJob"),
        ("POST", "/plan", dash.plan, "PlanJob"),
        ("GET", "/metrics", dash.metrics, ANY_CERT),
        ("GET", "/static/{name}", dash.static, ANY_CERT),
    ]
    for verb, path, handler, method in routes:
        route = guarded(method, tls, _answers(handler), revocations)
        app.router.add_route(verb, path, route)
        if verb == "GET":   # HTTP: a server that answers GET answers HEAD (aiohttp sends the head, no body)
            app.router.add_route("HEAD", path, route)
    return app


@dataclasses.dataclass
class HttpServer:
    """The running dashboard: ``port`` is the one bound; ``tls``: HTTPS with client certificates."""

    runner: web.AppRunner
    port: int
    tls: bool

    async def stop(self) -> None:
        await self.runner.cleanup()


def _host_port(listen: str) -> tuple[str, int]:
    """``security.tls.split_listen``, with ":PORT" meaning every interface and OSError for the CLI."""
    from rankctl.security.tls import split_listen

    try:
        return split_listen(f"0.0.0.0{listen}" if listen.startswith(":") else listen)
    except ValueError:
        raise OSError(f"--http-listen {listen!r} is not HOST:PORT (port 0 picks a free one)") from None


async def start_http(core: Any, listen: str, identity: Any = None, metrics_per_rank: bool = False) -> HttpServer:
    """Serve the dashboard on ``listen`` (HOST:PORT); with ``identity`` (an IdentityDir) HTTPS and client
    certificates only. OSError when the address cannot be bound."""
    from rankctl.security.tls import https_server_context

    app = build_app(Dashboard(core, metrics_per_rank), tls=identity is not None,
                    revocations=getattr(identity, "revocations", None))
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    host, port = _host_port(listen)
    site = web.TCPSite(runner, host, port, ssl_context=https_server_context(identity) if identity is not None else None)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return HttpServer(runner, runner.addresses[0][1], identity is not None)
