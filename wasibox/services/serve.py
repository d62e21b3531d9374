"""``wasibox serve``: an HTTP service that runs untrusted Python for authenticated tenants.

Why FastAPI (on Starlette): the request and response bodies are pydantic models, and FastAPI
derives both the validation (422 on a bad body) and the OpenAPI schema (``/openapi.json``)
from those same models, so the documented contract and the enforced one cannot drift. pydantic
is already a dependency (the config file is validated with it), and FastAPI adds only a thin
layer over Starlette, whose ASGI middleware and responses are used directly where FastAPI has
nothing to add (the gate below). Plain Starlette would mean writing the schema by hand.

Threat model of this boundary. Callers are untrusted until authenticated, and a tenant is
trusted only with its own policy:

* every ``/v1/`` request passes one gate first, before its body is read: a bearer token,
  matched by its SHA-256 against the config (401 otherwise), then the tenant's rate limit
  (429), then the body size cap (413). The tenant comes from the token alone: nothing in a
  request can name another tenant's policy;
* each tenant has its own ``Sandbox`` (its limits, grants, concurrency and queue), so one
  tenant's load fills only its own queue (429 when full). A client that disconnects cancels
  its run, so abandoned requests do not hold slots;
* responses carry only the RunResult (the guest's own output and traceback) or a short
  message: no host paths, no host stack traces. Unexpected errors are logged, not returned;
* ``/healthz`` and ``/metrics`` need no token and reveal only tenant names and counts: bind
  the service to an address only trusted scrapers can reach, or front it with a proxy.

Sessions (``/v1/sessions``, when the tenant's ``sessions.enabled``): a tenant opens a live
interpreter (``wasibox.Session``), runs code in it call after call, and deletes it. A session
belongs to the tenant that opened it: its id is looked up among that tenant's sessions only,
so another tenant's id is 404. Each call holds one of the tenant's ``max_concurrency`` slots
like any run (429 when the queue is full); a tenant holds at most ``sessions.max_sessions``
open at once (429 past it), and each ends at its idle timeout or maximum age, freeing its
guest. A call to an ended session is 410, saying why it ended.

Each run logs one JSON line (logger ``wasibox.serve``): tenant, operation, outcome, limit,
fuel, duration, exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import math
import secrets
import socket
import sys
import threading
import time
import types
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import prometheus_client
import pydantic
from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import _events, _result
from .._concurrency import RunHandle
from .._errors import Busy, ConfigError, SessionEnded, UsageError, WasiboxError
from .._events import CapabilityEvent
from .._result import RunResult
from .._sandbox import Sandbox
from .._session import Session
from .._version import __version__
from .config import Config, LimitsConfig, TenantConfig, hash_token

__all__ = ["CallRequest", "RunRequest", "SessionModel", "create_app", "make_sandbox", "serve"]

log = logging.getLogger("wasibox.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Latency histogram buckets, in seconds: a run takes from about a millisecond to its timeout.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)


# -- the HTTP contract ------------------------------------------------------------------------

class RunRequest(BaseModel):
    """Run ``code`` in a fresh interpreter under the tenant's policy."""

    model_config = ConfigDict(extra="forbid")
    code: str = Field(description="Python source to run")
    limits: LimitsConfig | None = Field(
        default=None,
        description="lower some of the tenant's limits for this run, with the keys of the "
                    "config file's limits table (fuel, timeout_s, memory_bytes, ...); a value "
                    "above the tenant's own is refused with 422")
    stdin: str | None = Field(default=None,
                              description="what the program reads from sys.stdin (default: "
                                          "empty); at most 16 times the source_bytes limit")
    argv: list[str] | None = Field(default=None,
                                   description="the program's whole sys.argv, argv[0] "
                                               "included (default: [''])")
    env: dict[str, str] | None = Field(default=None,
                                       description="the program's os.environ (default: "
                                                   "empty; the service's own never reaches "
                                                   "it)")


class CallRequest(RunRequest):
    """Run ``code``, then call its function ``entry`` with ``args`` and ``kwargs``."""

    entry: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=200,
                       description="the function to call, defined by ``code``")
    args: list[Any] = Field(default=[], description="positional arguments (JSON values)")
    kwargs: dict[str, Any] = Field(default={}, description="keyword arguments (JSON values)")


def _model_of(cls: type[Any], doc: str | None = None, *, types: dict[str, Any] | None = None,
              descriptions: dict[str, str] | None = None) -> type[BaseModel]:
    """A pydantic model of dataclass ``cls``, field for field and in its order, named
    ``<cls>Model``, so the documented response cannot drift from what it documents.

    A nested dataclass becomes its own model, a tuple a list and an enum its value, as in
    ``RunResult.to_dict()``; ``types`` replaces the type of a field whose JSON form differs.
    """
    hints = typing.get_type_hints(cls, globalns=_NAMESPACE)
    spec: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        kind = (types or {}).get(field.name) or _json_type(hints[field.name])
        description = (descriptions or {}).get(field.name)
        spec[field.name] = (kind, Field(description=description) if description else ...)
    return pydantic.create_model(f"{cls.__name__}Model", __doc__=doc or cls.__doc__, **spec)


_MODELS: dict[type[Any], type[BaseModel]] = {}
#: Where the result types' annotations are read (their ``__module__`` says ``wasibox``).
_NAMESPACE = {**vars(_events), **vars(_result)}


def _json_type(hint: Any) -> Any:
    """The JSON form of a field's type (see ``_model_of``)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if hint not in _MODELS:
            _MODELS[hint] = _model_of(hint)
        return _MODELS[hint]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return str
    arguments = typing.get_args(hint)
    if typing.get_origin(hint) in (list, tuple):
        return list[_json_type(arguments[0])]  # type: ignore[misc]
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return typing.Union[tuple(_json_type(argument) for argument in arguments)]  # noqa: UP007
    return hint


CapabilityEventModel = _model_of(CapabilityEvent, doc=(
    "One decision of a capability (an HTTP request, a host function call).\n\n"
    "``reason`` is always null in responses: it can say what a name resolved to."))

RunResultModel = _model_of(RunResult, doc=(
    "What one run produced (``wasibox.RunResult.to_dict()``). Every string is valid UTF-8\n"
    "(guest text that was not has U+FFFD in its place); in ``value``, bytes, NaN and infinities\n"
    "and maps with keys that are not strings are tagged objects: ``{\"base64\": ...}``,\n"
    "``{\"float\": \"nan\"}``, ``{\"map\": [[key, value], ...]}``."),
    types={"capability_log": list[CapabilityEventModel]},  # type: ignore[valid-type]
    descriptions={
        "limit_exceeded": "fuel, timeout, memory, output, host_calls or cancelled; null if "
                          "none was hit",
        "value": "the entry function's return value (call only)",
        "files": "files written under writable mounts (published only when ok)",
        "isolation": "wasm, or for the microVM kvm or tcg (emulation)",
    })


SessionRunResultModel = pydantic.create_model(
    "SessionRunResultModel", __base__=RunResultModel,
    __doc__="What one call in a session produced, and whether the session lives on.",
    session_ended=(str | None, Field(
        description="null while the session lives; else why this call ended it: limit "
                    "(limit_exceeded says which) or trap (the guest trapped or exited)")))


class SessionModel(BaseModel):
    """A live session: its id (give it in the path of its calls) and its bounds."""

    id: str
    idle_timeout_s: float = Field(description="the session ends after this long without a call")
    max_age_s: float = Field(description="the session ends this long after it was opened")
    memory_bytes: int = Field(description="the memory cap of the session's guest, for its life")


class ErrorModel(BaseModel):
    """Why a request was refused."""

    detail: str


class SessionGoneModel(ErrorModel):
    """A call to a session that has ended; nothing ran."""

    reason: str = Field(description="limit, trap, idle, max_age or closed")


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorModel, "description": "missing or unknown bearer token"},
    413: {"model": ErrorModel, "description": "request body over the configured cap"},
    422: {"model": ErrorModel, "description": "the body is not valid for this endpoint"},
    429: {"model": ErrorModel, "description": "rate limit hit, or the tenant's queue is full"},
}


# -- tenants ----------------------------------------------------------------------------------

class TokenBucket:
    """A token bucket: ``rate`` tokens a second, holding at most ``burst``.

    Not thread-safe: the service touches it only from its event loop.
    """

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._updated = clock()

    def take(self) -> float:
        """Take one token; return 0.0 on success, else the seconds until one is available."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
        self._updated = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate


class _Tenant:
    def __init__(self, name: str, config: TenantConfig, sandbox: Sandbox) -> None:
        self.name = name
        self.config = config
        self.sandbox = sandbox
        limit = config.rate_limit
        self.bucket = TokenBucket(limit.per_second, limit.burst) if limit else None
        self.sessions: dict[str, Session] = {}
        self.sessions_lock = threading.Lock()

    def open_session(self) -> tuple[str, Session] | None:
        """A new session and its id, or None if the tenant holds ``max_sessions`` already.

        Raises what ``Sandbox.session`` raises."""
        options = self.config.sessions
        with self.sessions_lock:
            for key in [key for key, live in self.sessions.items() if live.ended is not None]:
                del self.sessions[key]  # ended by a limit or an expiry: it holds nothing
            if len(self.sessions) >= options.max_sessions:
                return None
            session = self.sandbox.session(idle_timeout_s=options.idle_timeout_s,
                                           max_age_s=options.max_age_s)
            key = secrets.token_urlsafe(18)
            self.sessions[key] = session
            return key, session

    def open_sessions(self) -> int:
        """Sessions of this tenant still live: one ended by a limit or an expiry holds no
        guest, though its id answers 410 until the next open or delete forgets it."""
        with self.sessions_lock:
            return sum(1 for session in self.sessions.values() if session.ended is None)

    def find_session(self, key: str) -> Session | None:
        with self.sessions_lock:
            return self.sessions.get(key)

    def close_session(self, key: str) -> bool:
        with self.sessions_lock:
            session = self.sessions.pop(key, None)
        if session is None:
            return False
        session.close()
        return True


def make_sandbox(name: str, tenant: TenantConfig) -> Sandbox:
    """The Sandbox that enforces one tenant's policy: its limits, mounts, HTTP allowlist
    and host functions, and its share of the service (max_concurrency, max_queue).

    Raises ConfigError, naming the key, for a host function that cannot be imported or a
    policy the Sandbox refuses.
    """
    grants: dict[str, Any] = {
        "functions": tenant.resolve_functions(name),
        "mounts": [mount.to_mount() for mount in tenant.mounts],
        "http": tenant.http.to_policy() if tenant.http is not None else None,
    }
    try:
        return Sandbox(tenant.limits.to_limits(), seed=tenant.seed, clock=tenant.clock,
                       entropy=tenant.entropy, max_concurrency=tenant.max_concurrency,
                       max_queue=tenant.max_queue, backend=tenant.backend,
                       allow_emulation=tenant.allow_emulation, **grants,
                       **tenant.sandbox_options())
    except ConfigError:
        raise
    except UsageError as exc:  # e.g. two mounts at the same guest path
        raise ConfigError(f"tenants.{name}: {exc}") from None


# -- metrics ----------------------------------------------------------------------------------

class _Metrics:
    """Prometheus metrics of one app, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        r = self.registry
        self.runs = prometheus_client.Counter(
            "wasibox_runs", "Runs finished, by tenant and outcome (ok, error, limit)",
            ["tenant", "outcome"], registry=r)
        self.limits = prometheus_client.Counter(
            "wasibox_limits_exceeded", "Runs that hit a limit, by tenant and limit",
            ["tenant", "limit"], registry=r)
        self.duration = prometheus_client.Histogram(
            "wasibox_run_duration_seconds", "Wall-clock time of each run, queueing included",
            ["tenant"], buckets=DURATION_BUCKETS, registry=r)
        self.rejected = prometheus_client.Counter(
            "wasibox_requests_rejected", "Requests refused before running, by reason",
            ["reason"], registry=r)
        self.queue = prometheus_client.Gauge(
            "wasibox_queue_depth", "Runs waiting for a slot, by tenant", ["tenant"], registry=r)
        self.active = prometheus_client.Gauge(
            "wasibox_active_runs", "Runs holding a slot, by tenant", ["tenant"], registry=r)
        self.pool = prometheus_client.Gauge(
            "wasibox_pool_size", "Pre-made guest instances ready in the warm pool", registry=r)
        self.pool_target = prometheus_client.Gauge(
            "wasibox_pool_target_size", "Instances the warm pool keeps ready", registry=r)
        self.sessions = prometheus_client.Gauge(
            "wasibox_open_sessions", "Sessions open (live, not yet ended), by tenant",
            ["tenant"], registry=r)

    def render(self, tenants: dict[str, _Tenant]) -> bytes:
        for tenant in tenants.values():
            runner = tenant.sandbox._runner
            self.queue.labels(tenant.name).set(runner.queued)
            self.active.labels(tenant.name).set(runner.active)
            self.sessions.labels(tenant.name).set(tenant.open_sessions())
        from ..backends.wasm import runtime

        ready, target = runtime().pool_status()
        self.pool.set(ready)
        self.pool_target.set(target)
        return prometheus_client.generate_latest(self.registry)


# -- the gate: authentication, rate limits, body size ----------------------------------------

class _Gate:
    """ASGI middleware that admits a ``/v1/`` request before anything reads its body.

    Order: the bearer token (401), the tenant's rate limit (429), then the body cap (413,
    from Content-Length at once, or while the body streams in). The admitted tenant is put
    in ``scope["state"]["tenant"]``.
    """

    def __init__(self, app: ASGIApp, *, tenants: dict[str, _Tenant], max_body_bytes: int,
                 metrics: _Metrics) -> None:
        self.app = app
        self.by_digest = {t.config.token_sha256: t for t in tenants.values()
                          if t.config.token_sha256 is not None}
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        scheme, _, token = headers.get("authorization", "").partition(" ")
        tenant = (self.by_digest.get(hash_token(token.strip()))
                  if scheme.lower() == "bearer" and token.strip() else None)
        if tenant is None:
            self.metrics.rejected.labels("unauthorized").inc()
            await _refuse(send, 401, "a valid bearer token is required",
                          {"www-authenticate": 'Bearer realm="wasibox"'})
            return
        if tenant.bucket is not None and (wait := tenant.bucket.take()):
            self.metrics.rejected.labels("rate_limited").inc()
            await _refuse(send, 429, "rate limit exceeded; retry later",
                          {"retry-after": str(max(1, math.ceil(wait)))})
            return
        kind = headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if scope["method"] == "POST" and kind != "application/json":
            self.metrics.rejected.labels("invalid").inc()
            await _refuse(send, 415, "send the body as JSON (Content-Type: application/json)")
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            self.metrics.rejected.labels("too_large").inc()
            await _refuse(send, 413, f"the request body is over {self.max_body_bytes} bytes")
            return
        scope.setdefault("state", {})["tenant"] = tenant
        # Read the (capped) body here, so a body streamed without Content-Length is refused
        # with 413 as it arrives; the app then reads it from memory, as it would anyway.
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_body_bytes:
                self.metrics.rejected.labels("too_large").inc()
                await _refuse(send, 413, f"the request body is over {self.max_body_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


async def _refuse(send: Send, status: int, detail: str,
                  headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


# -- the app ----------------------------------------------------------------------------------

def create_app(config: Config, *, on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The ASGI application for ``config``: one Sandbox per tenant, closed at shutdown.

    Raises ConfigError for a tenant without a ``token_sha256`` and for a tenant whose
    policy cannot be enforced (see ``make_sandbox``).
    """
    tokenless = [name for name, tenant in config.tenants.items() if tenant.token_sha256 is None]
    if tokenless:
        raise ConfigError(f"tenants.{tokenless[0]}.token_sha256: wasibox serve needs it to "
                          "know the tenant's requests: the hex SHA-256 of its bearer token "
                          "(printf %s \"$TOKEN\" | sha256sum)")
    tenants: dict[str, _Tenant] = {}
    try:
        for name, tenant_config in config.tenants.items():
            tenants[name] = _Tenant(name, tenant_config, make_sandbox(name, tenant_config))
    except BaseException:
        for tenant in tenants.values():
            tenant.sandbox.close()
        raise
    metrics = _Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            for tenant in tenants.values():
                tenant.sandbox.close()

    app = FastAPI(
        title="wasibox", version=__version__, lifespan=lifespan,
        description="Run untrusted Python in a CPython interpreter compiled to WebAssembly. "
                    "Each request runs in a fresh interpreter under the policy of the tenant "
                    "its bearer token belongs to.",
        docs_url=None, redoc_url=None)  # interactive docs load scripts from a CDN: off
    bearer = HTTPBearer(auto_error=False, description="the tenant's token")

    async def execute(request: Request, op: str, body: RunRequest,
                      session: Session | None = None) -> Response:
        tenant: _Tenant = request.state.tenant
        started = time.perf_counter()
        narrow = body.limits.model_dump(exclude_none=True) if body.limits else None
        try:
            stdin, argv, env = body.stdin, body.argv, body.env
            if session is not None:
                handle = session.start(body.code, limits=narrow, stdin=stdin, argv=argv,
                                       env=env)
            elif isinstance(body, CallRequest):
                handle = tenant.sandbox.start(body.code, entry=body.entry, args=body.args,
                                              kwargs=body.kwargs, limits=narrow, stdin=stdin,
                                              argv=argv, env=env)
            else:
                handle = tenant.sandbox.start(body.code, limits=narrow, stdin=stdin,
                                              argv=argv, env=env)
            result = await _unless_disconnected(request, handle)
        except SessionEnded as exc:
            _log_run(tenant.name, op, "session_ended", None, time.perf_counter() - started)
            return JSONResponse({"detail": str(exc), "reason": exc.reason}, status_code=410)
        except Busy:
            metrics.rejected.labels("busy").inc()
            _log_run(tenant.name, op, "busy", None, time.perf_counter() - started)
            return JSONResponse({"detail": "too many runs in progress for this tenant; "
                                 "retry later"}, status_code=429, headers={"retry-after": "1"})
        except UsageError as exc:
            metrics.rejected.labels("invalid").inc()
            _log_run(tenant.name, op, "invalid", None, time.perf_counter() - started)
            return JSONResponse({"detail": str(exc)}, status_code=422)
        except WasiboxError:
            log.exception("wasibox could not run a request for tenant %s", tenant.name)
            return JSONResponse({"detail": "the sandbox is unavailable"}, status_code=503)
        elapsed = time.perf_counter() - started
        outcome = "ok" if result.ok else ("limit" if result.limit_exceeded else "error")
        metrics.runs.labels(tenant.name, outcome).inc()
        metrics.duration.labels(tenant.name).observe(elapsed)
        if result.limit_exceeded is not None:
            metrics.limits.labels(tenant.name, result.limit_exceeded.value).inc()
        _log_run(tenant.name, op, outcome, result, elapsed)
        data = _result_json(result)
        if session is not None:
            data["session_ended"] = session.ended.value if session.ended else None
        return JSONResponse(data)

    @app.post("/v1/run", response_model=RunResultModel, responses=_ERRORS,
              dependencies=[Security(bearer)], summary="Run code")
    async def run_code(body: RunRequest, request: Request) -> Response:
        """Run ``code`` in a fresh interpreter; the result says what happened."""
        return await execute(request, "run", body)

    @app.post("/v1/call", response_model=RunResultModel, responses=_ERRORS,
              dependencies=[Security(bearer)], summary="Run code, then call a function")
    async def call_function(body: CallRequest, request: Request) -> Response:
        """Run ``code``, then call ``entry(*args, **kwargs)``; its return value is ``value``."""
        return await execute(request, "call", body)

    def sessions_of(request: Request) -> _Tenant:
        tenant: _Tenant = request.state.tenant
        if not tenant.config.sessions.enabled:
            raise StarletteHTTPException(403, f"sessions are turned off for this tenant "
                                              f"(tenants.{tenant.name}.sessions.enabled)")
        return tenant

    def session_of(request: Request, session_id: str) -> Session:
        session = sessions_of(request).find_session(session_id)
        if session is None:
            raise StarletteHTTPException(404, "no such session for this tenant (it was "
                                              "deleted, or never existed)")
        return session

    @app.post("/v1/sessions", response_model=SessionModel, status_code=201,
              responses={**_ERRORS, 403: {"model": ErrorModel,
                                          "description": "sessions are off for this tenant"}},
              dependencies=[Security(bearer)], summary="Open a session")
    async def open_session(request: Request) -> Response:
        """Open a live interpreter whose variables, imports and open files persist from one
        call to the next; 429 if the tenant already holds ``sessions.max_sessions``."""
        tenant = sessions_of(request)
        try:
            opened = await asyncio.to_thread(tenant.open_session)
        except WasiboxError:
            log.exception("wasibox could not open a session for tenant %s", tenant.name)
            return JSONResponse({"detail": "the sandbox is unavailable"}, status_code=503)
        if opened is None:
            metrics.rejected.labels("busy").inc()
            return JSONResponse({"detail": f"this tenant already holds "
                                 f"{tenant.config.sessions.max_sessions} open sessions; delete "
                                 "one, or retry when one expires"}, status_code=429)
        key, session = opened
        return JSONResponse({"id": key, "idle_timeout_s": session.idle_timeout_s,
                             "max_age_s": session.max_age_s,
                             "memory_bytes": tenant.sandbox.limits.memory_bytes},
                            status_code=201)

    @app.post("/v1/sessions/{session_id}/run", response_model=SessionRunResultModel,
              responses={**_ERRORS, 404: {"model": ErrorModel, "description": "no such session"},
                         410: {"model": SessionGoneModel,
                               "description": "the session has ended"}},
              dependencies=[Security(bearer)], summary="Run code in a session")
    async def run_in_session(session_id: str, body: RunRequest, request: Request) -> Response:
        """Run ``code`` in the session's interpreter. A call that exceeds a limit ends the
        session (``session_ended`` says so); later calls get 410."""
        return await execute(request, "session_run", body, session_of(request, session_id))

    @app.delete("/v1/sessions/{session_id}", status_code=204,
                responses={**_ERRORS, 404: {"model": ErrorModel,
                                            "description": "no such session"}},
                dependencies=[Security(bearer)], summary="Delete a session")
    async def delete_session(session_id: str, request: Request) -> Response:
        """End the session and free its guest (a call in progress finishes first)."""
        if not await asyncio.to_thread(sessions_of(request).close_session, session_id):
            raise StarletteHTTPException(404, "no such session for this tenant")
        return Response(status_code=204)

    @app.get("/healthz", summary="Liveness")
    async def healthz() -> dict[str, str]:
        """``{"status": "ok"}`` while the service accepts requests."""
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics_endpoint() -> Response:
        """Runs by outcome, limits exceeded, latency histogram, pool size, queue depth,
        open sessions."""
        return Response(metrics.render(tenants),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        metrics.rejected.labels("invalid").inc()
        problems = [_problem(error) for error in exc.errors()]
        return JSONResponse({"detail": "; ".join(problems) or "invalid request"},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400:  # FastAPI could not parse the body at all
            metrics.rejected.labels("invalid").inc()
            return JSONResponse({"detail": "the body is not valid JSON (or is nested too "
                                 "deeply)"}, status_code=422)
        return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("unexpected error on %s %s", request.method, request.url.path,
                  exc_info=exc)
        return JSONResponse({"detail": "internal error"}, status_code=500)

    app.add_middleware(_Gate, tenants=tenants,
                       max_body_bytes=config.server.max_body_bytes, metrics=metrics)
    return app


async def _unless_disconnected(request: Request, handle: RunHandle) -> RunResult:
    """Await the run; if the client goes away first, cancel it so its slot is freed at once
    (its result then says ``cancelled``)."""

    async def finished() -> RunResult:
        return await handle

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    run = asyncio.ensure_future(finished())
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the server is shutting down: stop the guest too
        handle.cancel()
        raise
    finally:
        gone.cancel()
    if not run.done():
        handle.cancel()
    return await run


def _problem(error: Any) -> str:
    """One validation error as ``location: message``, without echoing the input."""
    if error["type"] == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "malformed")
        return f"the body is not valid JSON ({reason} at character {error['loc'][-1]})"
    location = ".".join(str(part) for part in error["loc"])
    return f"{location}: {error['msg']}"


def _log_run(tenant: str, op: str, outcome: str, result: RunResult | None,
             duration_s: float) -> None:
    log.info(json.dumps({
        "event": "run", "tenant": tenant, "op": op, "outcome": outcome,
        "limit": result.limit_exceeded.value if result and result.limit_exceeded else None,
        "fuel": result.fuel_used if result else 0,
        "exit_code": result.exit_code if result else None,
        "duration_s": round(duration_s, 6),
    }, separators=(",", ":")))


def _result_json(result: RunResult) -> dict[str, Any]:
    data = result.to_dict()
    # A denial's reason can say what a name resolved to (an internal address): that stays
    # on the host. The tenant sees what was decided, not why.
    data["capability_log"] = [{**event, "reason": None} for event in data["capability_log"]]
    return data


# -- running it -------------------------------------------------------------------------------

def serve(config_path: str, host: str = "127.0.0.1", port: int = 8080, *,
          log_level: str = "info") -> int:
    """Load ``config_path`` and serve it with uvicorn until interrupted; return 0.

    ``port=0`` picks a free port; the address is printed on stderr once the service is
    ready (``wasibox serve: listening on http://HOST:PORT``). Raises ConfigError for a bad
    configuration and OSError if the address cannot be bound.
    """
    import uvicorn

    from .config import load_config

    config = load_config(config_path)
    for name, tenant in config.tenants.items():
        for warning in tenant.warnings(name):
            print(f"wasibox serve: warning: {warning}", file=sys.stderr, flush=True)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(log_level.upper())
    log.propagate = False

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if family == socket.AF_INET6 else host

    def ready() -> None:
        print(f"wasibox serve: listening on http://{shown}:{bound}", file=sys.stderr,
              flush=True)

    try:
        app = create_app(config, on_ready=ready)
        server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", access_log=False, server_header=False,
            lifespan="on", timeout_graceful_shutdown=10,
            # Longer than clients' idle timeouts, so a client never sends on a connection
            # the server is closing at that moment (the request would be lost).
            timeout_keep_alive=75))
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
