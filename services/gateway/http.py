"""OpenAI-compatible HTTP edge of the gateway (FastAPI), served by uvicorn in the service's loop.

Owns: the OpenAI wire format (`/v1/chat/completions`, `/v1/completions`, streaming as SSE
`data: …` events ending in `data: [DONE]`, `/v1/models`), OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}` for every refusal, and hotloop's additions:
`X-Hotloop-Response-Id` / `X-Hotloop-Policy-Version` / `X-Hotloop-Tenant` (the lineage that
served it) headers and a `policy_version` field in every body and chunk, `POST /v1/feedback`,
`/v1/hotloop/status` (a user key: its own tenant's view; the admin token: every tenant's)
and `/metrics` (the admin token only: its series name every tenant); `/health` (liveness:
the process answers) and `/ready` (readiness: `GatewayCore.readiness`), both without a key
(neither names a tenant); the request-body bounds
(`_BoundedBody`); and the tenant admin API's routes (`/admin/tenants...`, with the admin
token) and `GET /v1/adapter` (a user's own tenant's latest version, as a tar), whose
operations are admin.py's.
Does not own: any decision (core.py, admin.py); this module only converts.

A failure after the stream started cannot change the status code: it is sent as one
`data: {"error": …}` event and the stream closes without `[DONE]` (the openai client raises
`APIError` on it), so a truncated answer never looks complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotloop.errors import (
    AlreadyExists,
    Conflict,
    DeadlineExceeded,
    FailedPrecondition,
    FatalError,
    HotloopError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from hotloop.tenants import DEFAULT

from .admin import Export, TenantAdmin
from .core import BadRequest, GatewayCore, Generation
from .types import Delta, FeedbackIn, GenerateIn, Message

log = logging.getLogger(__name__)

RESPONSE_ID_HEADER = "X-Hotloop-Response-Id"
POLICY_VERSION_HEADER = "X-Hotloop-Policy-Version"
ADAPTER_SHA_HEADER = "X-Hotloop-Adapter-Sha256"
TENANT_HEADER = "X-Hotloop-Tenant"  # the tenant whose lineage served the response ("": default)


# ---- the OpenAI wire format (only what the gateway reads; other fields are ignored) --------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessageBody(_Body):
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class ChatRequest(_Body):
    model: str
    messages: list[ChatMessageBody]
    n: int = 1
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Body):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class TenantBody(_Body):
    name: str


class ResetBody(BaseModel):
    # forbid: a misspelt field would otherwise reset to the base model, silently
    model_config = ConfigDict(extra="forbid")

    version: int = Field(0, ge=0)
    """The lineage's own version to go back to (0: the base model)."""


class FeedbackBody(_Body):
    response_id: str
    score: float | None = None
    label: str = ""
    text: str = ""
    choice: int = 0


# ---- errors ----------------------------------------------------------------------------
_STATUS: list[tuple[type[HotloopError], int, str, str | None]] = [
    # (error, HTTP status, OpenAI type, OpenAI code); first match wins
    (Unauthenticated, 401, "invalid_request_error", "invalid_api_key"),
    (PermissionDenied, 403, "invalid_request_error", "permission_denied"),
    (NotFound, 404, "invalid_request_error", "model_not_found"),
    (AlreadyExists, 409, "invalid_request_error", "already_exists"),
    (Conflict, 409, "invalid_request_error", "conflict"),
    (InvalidArgument, 400, "invalid_request_error", None),
    (FailedPrecondition, 400, "invalid_request_error", "failed_precondition"),
    (DeadlineExceeded, 504, "server_error", "timeout"),
    (Unavailable, 503, "server_error", "service_unavailable"),
    (FatalError, 503, "server_error", "service_unavailable"),
]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_of(e: HotloopError, not_found: str = "model_not_found") -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) of `e`; `not_found`: the code of a NotFound (the
    OpenAI endpoints' is a model; the admin API's a tenant or a version)."""
    for cls, status, type_, code in _STATUS:
        if isinstance(e, cls):
            code = not_found if cls is NotFound else code
            return status, error_body(str(e), type_, getattr(e, "param", None), code)
    return 500, error_body(str(e), "server_error")


def _error_response(status: int, body: dict) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


# A refused body is still read (and dropped) before the answer: for at most LINGER_S, and at
# most LINGER_LIMITS times the body limit (see _BoundedBody).
LINGER_S = 1.0
LINGER_LIMITS = 4


class _BoundedBody:
    """ASGI middleware: reads each request's body before the app does, and refuses it once
    more than `max_bytes` have arrived (413) or it has not arrived within `timeout_s` (408).

    The bound is on the bytes actually received, whatever the framing: a Content-Length over
    the limit is refused before anything is read, and a chunked body, which declares nothing,
    is counted as it arrives. A Content-Length smaller than what the client sends bounds the
    body by itself (the server reads that many bytes as this request's). The app gets the
    body in one piece; later `receive` calls (the disconnect a streaming response listens
    for) go to the server.

    A refusal closes the connection, but first reads and drops what the client is still
    sending, up to `LINGER_LIMITS` x `max_bytes` more within `LINGER_S` (nothing for
    `Expect: 100-continue`, whose client waits): closing a socket with unread input sends a
    TCP reset, which can reach the client before it has read the answer (rarely on loopback,
    where the tests run; over a network, as HTTP servers' lingering close knows). So at most
    (1 + `LINGER_LIMITS`) x `max_bytes` of a body are read and at most `max_bytes` of it
    held; past that an endless sender is cut off."""

    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await self._linger(receive)
            return await self._refuse(413, scope, send)
        body = bytearray()
        try:
            async with asyncio.timeout(self.timeout_s):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # nobody to answer
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(body) > self.max_bytes:
                        if more:
                            await self._linger(receive)
                        return await self._refuse(413, scope, send)
        except TimeoutError:
            await self._linger(receive)
            return await self._refuse(408, scope, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _linger(self, receive) -> None:
        dropped = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LINGER_S):
                while dropped <= LINGER_LIMITS * self.max_bytes:
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body", False):
                        return
                    dropped += len(message.get("body", b""))

    async def _refuse(self, status: int, scope, send) -> None:
        message = (f"the request body exceeds {self.max_bytes} bytes" if status == 413 else
                   f"the request body did not arrive within {self.timeout_s:g}s")
        code = None if status == 413 else "request_timeout"
        response = JSONResponse(error_body(message, "invalid_request_error", None, code),
                                status_code=status, headers={"Connection": "close"})
        await response(scope, _no_body, send)


async def _no_body():
    return {"type": "http.disconnect"}


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


# ---- conversion ------------------------------------------------------------------------
def _stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _content(i: int, m: ChatMessageBody) -> str:
    if m.content is None:
        raise BadRequest(f"messages[{i}].content is missing", f"messages[{i}].content")
    if isinstance(m.content, str):
        return m.content
    if any(p.type != "text" or p.text is None for p in m.content):
        raise BadRequest(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
    return "".join(p.text for p in m.content)


def chat_input(body: ChatRequest) -> GenerateIn:
    return GenerateIn(
        messages=[Message(m.role, _content(i, m)) for i, m in enumerate(body.messages)],
        model=body.model, n=body.n,
        max_tokens=body.max_completion_tokens or body.max_tokens or 0,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=_stop(body.stop), logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0,
    )


def completion_input(body: CompletionRequest) -> GenerateIn:
    if body.echo:
        raise BadRequest("echo is not supported", "echo")
    if body.best_of not in (None, body.n):
        raise BadRequest("best_of is not supported (use n)", "best_of")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if any(not isinstance(p, str) for p in prompts):
        raise BadRequest("token-id prompts are not supported: send text", "prompt")
    return GenerateIn(
        prompts=list(prompts), model=body.model, n=body.n, max_tokens=body.max_tokens or 0,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, stop=_stop(body.stop),
        logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
    )


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def chat_logprobs(d: Delta) -> dict | None:
    if d.logprobs is None:
        return None
    return {"content": [
        {"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token),
         "top_logprobs": [{"token": a, "logprob": lp, "bytes": _bytes(a)} for a, lp in t.top]}
        for t in d.logprobs
    ], "refusal": None}


class _Offsets:
    """Text offsets of completion tokens, across the chunks of each choice."""

    def __init__(self):
        self._at: dict[int, int] = {}

    def logprobs(self, d: Delta, top_k: int) -> dict | None:
        if d.logprobs is None:
            return None
        start = self._at.get(d.choice, 0)
        offsets = []
        for t in d.logprobs:
            offsets.append(start)
            start += len(t.token)
        self._at[d.choice] = start
        return {
            "tokens": [t.token for t in d.logprobs],
            "token_logprobs": [t.logprob for t in d.logprobs],
            "top_logprobs": [dict(t.top) for t in d.logprobs] if top_k else None,
            "text_offset": offsets,
        }


def _usage(g: Generation) -> dict:
    u = g.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}


@dataclass
class _Api:
    """How one endpoint renders: chat or legacy completions."""

    object: str
    chunk_object: str
    chunk_choice: Callable[[Delta, bool], dict]  # (delta, first of its choice) -> choice dict
    whole_choice: Callable[[int, list[Delta]], dict]


def _chat_api() -> _Api:
    def chunk_choice(d: Delta, first: bool) -> dict:
        delta: dict[str, Any] = {"content": d.text}
        if first:
            delta = {"role": "assistant", **delta}
        return {"index": d.choice, "delta": delta, "logprobs": chat_logprobs(d),
                "finish_reason": d.finish_reason or None}

    def whole_choice(i: int, ds: list[Delta]) -> dict:
        lps = [chat_logprobs(d) for d in ds]
        return {
            "index": i,
            "message": {"role": "assistant", "content": "".join(d.text for d in ds)},
            "logprobs": None if not ds or lps[0] is None else
            {"content": [t for lp in lps for t in lp["content"]], "refusal": None},
            "finish_reason": ds[-1].finish_reason if ds else None,
            "policy_version": ds[-1].policy_version if ds else None,
        }

    return _Api("chat.completion", "chat.completion.chunk", chunk_choice, whole_choice)


def _completion_api(top_k: int) -> _Api:
    offsets = _Offsets()

    def chunk_choice(d: Delta, first: bool) -> dict:
        return {"index": d.choice, "text": d.text, "logprobs": offsets.logprobs(d, top_k),
                "finish_reason": d.finish_reason or None}

    def whole_choice(i: int, ds: list[Delta]) -> dict:
        lps = [offsets.logprobs(d, top_k) for d in ds]
        merged = None
        if ds and lps[0] is not None:
            merged = {k: [x for lp in lps for x in lp[k]] for k in ("tokens", "token_logprobs", "text_offset")}
            merged["top_logprobs"] = [x for lp in lps for x in lp["top_logprobs"]] if top_k else None
        return {"index": i, "text": "".join(d.text for d in ds), "logprobs": merged,
                "finish_reason": ds[-1].finish_reason if ds else None,
                "policy_version": ds[-1].policy_version if ds else None}

    return _Api("text_completion", "text_completion", chunk_choice, whole_choice)


def _headers(g: Generation) -> dict[str, str]:
    return {RESPONSE_ID_HEADER: g.response_id, POLICY_VERSION_HEADER: str(g.policy_version),
            TENANT_HEADER: g.served_tenant}


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _whole(g: Generation, api: _Api) -> JSONResponse:
    by_choice: dict[int, list[Delta]] = {i: [] for i in range(g.choices)}
    try:
        async for d in g:
            by_choice[d.choice].append(d)
    except HotloopError as e:
        status, body = error_of(e)
        return JSONResponse(body, status_code=status, headers=_headers(g))
    body = {
        "id": g.response_id, "object": api.object, "created": g.created, "model": g.model,
        "choices": [api.whole_choice(i, ds) for i, ds in by_choice.items()],
        "usage": _usage(g), "policy_version": g.policy_version, "system_fingerprint": None,
    }
    return JSONResponse(body, headers=_headers(g))


async def _stream(g: Generation, api: _Api, include_usage: bool) -> AsyncIterator[bytes]:
    started: set[int] = set()
    base = {"id": g.response_id, "object": api.chunk_object, "created": g.created, "model": g.model,
            "system_fingerprint": None}
    try:
        async for d in g:
            first = d.choice not in started
            started.add(d.choice)
            yield _sse({**base, "choices": [api.chunk_choice(d, first)],
                        "policy_version": d.policy_version})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(g), "policy_version": g.policy_version})
        yield _sse("[DONE]")
    except HotloopError as e:
        _, body = error_of(e)
        yield _sse(body)  # and close without [DONE]: see the module docstring
    finally:
        await g.aclose()


async def _respond(g: Generation, api: _Api, stream: bool, include_usage: bool):
    if stream:
        return StreamingResponse(_stream(g, api, include_usage), media_type="text/event-stream",
                                 headers={**_headers(g), "Cache-Control": "no-cache"})
    return await _whole(g, api)


# ---- the app ---------------------------------------------------------------------------
def _export_response(x: Export) -> StreamingResponse:
    return StreamingResponse(x.chunks(), media_type="application/x-tar", headers={
        "Content-Disposition": f'attachment; filename="{x.tenant}-v{x.version}.tar"',
        "Content-Length": str(x.bytes), POLICY_VERSION_HEADER: str(x.version),
        ADAPTER_SHA_HEADER: x.sha256})


def build_app(core: GatewayCore, admin: TenantAdmin | None = None) -> FastAPI:
    """`admin`: the tenant admin API's operations (none: the admin API answers 403)."""
    app = FastAPI(title="hotloop gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_BoundedBody, max_bytes=core.cfg.max_request_bytes,
                       timeout_s=core.cfg.request_body_timeout_s)

    @app.exception_handler(HotloopError)
    async def _hotloop_error(request: Request, e: HotloopError):
        admin_path = request.url.path.startswith(("/admin/", "/v1/adapter"))
        return _error_response(*error_of(e, "not_found" if admin_path else "model_not_found"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return _error_response(400, error_body("the request body is not valid JSON", "invalid_request_error"))
        param = _param(tuple(first.get("loc", ())))
        msg = f"{param or 'body'}: {first.get('msg', 'invalid')}"
        return _error_response(400, error_body(msg, "invalid_request_error", param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return _error_response(e.status_code, error_body(str(e.detail), "invalid_request_error"))

    def user(request: Request) -> str:
        return core.authenticate(request.headers.get("authorization"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        r = core.readiness()
        return JSONResponse({"status": "ready" if r.ready else "not_ready", "reason": r.reason},
                            status_code=200 if r.ready else 503)

    def is_operator(request: Request) -> bool:
        return admin is not None and admin.is_admin(request.headers.get("authorization"))

    @app.get("/metrics")
    async def metrics(request: Request):
        # The registry the process's metrics endpoint (`[gateway] metrics_port`, the operator's
        # listener) serves, also here for a scraper that reaches only this port: with the admin
        # token only, since its series name every tenant (labels) and count every tenant's
        # traffic, and this port is every tenant's users'.
        if not is_operator(request):
            try:
                core.keys.authenticate(request.headers.get("authorization"))
            except Unauthenticated:
                raise Unauthenticated("/metrics on the users' port needs `Authorization: Bearer "
                                      "<admin token>` (or scrape [gateway] metrics_port)") from None
            raise PermissionDenied("a user API key cannot read /metrics: it covers every "
                                   "tenant (the operator scrapes [gateway] metrics_port)")
        encode, content_type = choose_encoder(request.headers.get("accept"))
        return Response(encode(core.registry), media_type=content_type)

    @app.get("/v1/hotloop/status")
    async def status(request: Request):
        # the admin token: every tenant (the operator's view); a user key: its tenant alone
        if is_operator(request):
            return core.status()
        return core.tenant_status(core.tenants.tenant_of(user(request)))

    def model_card() -> dict:
        return {"id": core.served_model, "object": "model", "created": 0, "owned_by": "hotloop"}

    @app.get("/v1/models")
    async def models(key: str = Depends(user)):
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, key: str = Depends(user)):
        if model != core.served_model:
            raise NotFound(f"the model {model!r} does not exist; this gateway serves {core.served_model!r}")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, key: str = Depends(user)):
        g = await core.generate(chat_input(body), key)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _respond(g, _chat_api(), body.stream, include_usage)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, key: str = Depends(user)):
        g = await core.generate(completion_input(body), key)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        api = _completion_api(body.logprobs or 0)
        return await _respond(g, api, body.stream, include_usage)

    @app.post("/v1/feedback")
    async def feedback(body: FeedbackBody, key: str = Depends(user)):
        r = await core.submit_feedback(
            FeedbackIn(body.response_id, body.score, body.label, body.text, body.choice), key)
        if not r.accepted:
            status = 404 if r.outcome == "unknown_response" else 400
            code: Literal["unknown_response", "invalid_feedback"] = (
                "unknown_response" if status == 404 else "invalid_feedback")
            return _error_response(status, error_body(r.reason, "invalid_request_error", None, code))
        return {"accepted": True, "reason": r.reason, "response_id": body.response_id,
                "choice": body.choice}

    # ---- the tenant admin API (admin.py) ----------------------------------------------
    def operator(request: Request) -> TenantAdmin:
        if admin is None:
            raise PermissionDenied("admin API disabled: this gateway has no tenant registry")
        admin.check_admin(request.headers.get("authorization"))
        return admin

    @app.post("/admin/tenants", status_code=201)
    async def create_tenant(body: TenantBody, a: TenantAdmin = Depends(operator)):
        return await a.create(body.name)

    @app.get("/admin/tenants")
    async def list_tenants(a: TenantAdmin = Depends(operator)):
        return {"tenants": await a.list()}

    @app.get("/admin/tenants/{name}")
    async def get_tenant(name: str, a: TenantAdmin = Depends(operator)):
        return await a.get(name)

    @app.post("/admin/tenants/{name}/keys", status_code=201)
    async def add_key(name: str, a: TenantAdmin = Depends(operator)):
        return await a.add_key(name)

    @app.post("/admin/tenants/{name}/reset", status_code=202)
    async def reset_tenant(name: str, body: ResetBody | None = None,
                           a: TenantAdmin = Depends(operator)):
        return await a.reset(name, body.version if body is not None else 0)

    @app.post("/admin/tenants/{name}/hold", status_code=202)
    async def hold_tenant(name: str, a: TenantAdmin = Depends(operator)):
        return await a.hold(name, True)

    @app.post("/admin/tenants/{name}/resume", status_code=202)
    async def resume_tenant(name: str, a: TenantAdmin = Depends(operator)):
        return await a.hold(name, False)

    @app.delete("/admin/tenants/{name}")
    async def delete_tenant(name: str, a: TenantAdmin = Depends(operator)):
        return await a.delete(name)

    @app.get("/admin/tenants/{name}/adapter")
    async def export_tenant(name: str, a: TenantAdmin = Depends(operator)):
        return _export_response(await a.export(name))

    @app.get("/v1/adapter")
    async def export_own(key: str = Depends(user)):
        tenant = core.tenants.tenant_of(key)
        if tenant == DEFAULT or admin is None:
            raise NotFound("no tenant: this key is in the default tenant, which has no adapter "
                           "of its own to export")
        return _export_response(await admin.export(tenant))

    return app


# ---- serving ---------------------------------------------------------------------------
class _Server:
    """uvicorn inside the service's own event loop, beside the gRPC server."""

    def __init__(self, app: FastAPI, host: str, port: int):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                # hotloop.service owns SIGINT/SIGTERM and stops this server in its cleanup
                yield

        self._server = Server(uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=5,
        ))
        self._task: asyncio.Task | None = None
        self.port = 0

    async def start(self) -> int:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                try:
                    self._task.result()
                except BaseException as e:  # uvicorn exits the process on a bind failure
                    raise FatalError(f"the HTTP server did not start: {e!r}") from None
                raise FatalError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None


async def serve_http(core: GatewayCore, host: str, port: int,
                     admin: TenantAdmin | None = None) -> _Server:
    server = _Server(build_app(core, admin), host, port)
    await server.start()
    return server
