"""The HTTP side of `python -m minscope.serve`: the OpenAI chat-completions routes, the
request checks (strict types, limits; one RequestError per bad request), the Job a request
becomes, and the Guard in front of every route (API key, body size). The model side, the
`Generator` that runs the Jobs, and the command line are in serve.py (which imports this
module; this one does not import it)."""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

MAX_N = 16
MAX_MESSAGES = 2048
MAX_BODY_BYTES = 4 * 2**20    # a full 40k-token context is well under 1 MB of JSON


class RequestError(ValueError):
    """What is wrong with one request: answered to it alone, with `status` (4xx)."""

    def __init__(self, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Job:
    messages: list[dict]
    temperature: float
    max_tokens: int
    n: int = 1
    thinking: bool = False
    future: Future = field(default_factory=Future)
    ids: list[int] | None = None          # the prompt's token ids, once checked


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list | None = None


class ChatRequest(BaseModel):
    """The fields of an OpenAI chat-completions request that are read; others are ignored.
    Strict types, as the OpenAI API checks them: "5" is not a number, "no" not a boolean."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str
    messages: list[Message]
    temperature: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stream: bool = False
    chat_template_kwargs: dict | None = None


def build_app(generator, name: str, max_tokens: int = 512, api_key: str | None = None,
              max_body: int = MAX_BODY_BYTES, max_messages: int = MAX_MESSAGES):
    """The FastAPI app serving `generator` as model `name`; with `api_key`, every request must
    carry it as a bearer token. Bodies over `max_body` bytes are refused before being read."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title=f"minscope simulator {name}")
    app.add_middleware(Guard, api_key=api_key, max_body=max_body)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):     # OpenAI answers a wrongly typed field with 400, not 422
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return error(400, f"invalid {where!r}: {first.get('msg', 'cannot be read')}", "invalid_type")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):   # a body that is not JSON (or nested too deeply), a wrong path
        return error(exc.status_code, str(exc.detail), None)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "minscope"}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        try:
            job = read_request(req, name, max_tokens, max_messages)
            result = await asyncio.wrap_future(generator.submit(job))
        except RequestError as e:
            return error(e.status, str(e), e.code)
        except Exception as e:  # noqa: BLE001 - this request failed; the server goes on
            return error(500, f"generation failed: {type(e).__name__}: {e}", "server_error", "server_error")
        prompt, completion = result["prompt_tokens"], result["completion_tokens"]
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": name, "choices": result["choices"],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}

    return app


def error(status: int, message: str, code: str | None = None, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status)


def read_request(req: ChatRequest, name: str, max_tokens: int, max_messages: int) -> Job:
    """The Job of a chat-completions request, or RequestError saying what is wrong with it."""
    if req.model != name:
        raise RequestError(f"the model {req.model!r} does not exist; this server serves {name!r}", 404,
                           "model_not_found")
    if req.stream:
        raise RequestError("streaming is not supported by minscope.serve; send stream: false")
    if not 1 <= req.n <= MAX_N:
        raise RequestError(f"n must be between 1 and {MAX_N}, not {req.n}")
    if not 1 <= len(req.messages) <= max_messages:
        raise RequestError(f"messages must hold 1 to {max_messages} messages, not {len(req.messages)}")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0 <= temperature <= 10:
        raise RequestError(f"temperature must be between 0 and 10, not {temperature}")
    cap = next((c for c in (req.max_completion_tokens, req.max_tokens) if c is not None), max_tokens)
    if cap < 1:
        raise RequestError(f"max_tokens must be at least 1, not {cap}", code="integer_below_min_value")
    thinking = (req.chat_template_kwargs or {}).get("enable_thinking", False)
    if not isinstance(thinking, bool):
        raise RequestError(f"chat_template_kwargs.enable_thinking must be true or false, not {thinking!r}",
                           code="invalid_type")
    messages = []
    for i, m in enumerate(req.messages):
        text = _text_content(m.content)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(f"messages[{i}].content is not valid Unicode (a lone UTF-16 surrogate, "
                               "such as \\ud800)") from None
        messages.append({"role": m.role, "content": text})
    return Job(messages, temperature, min(cap, max_tokens), req.n, thinking)


class Guard:
    """ASGI middleware in front of every route: the API key (when one is set), then a body of
    at most `max_body` bytes, read here in full before the app parses it (a declared
    Content-Length over the limit is refused without reading)."""

    def __init__(self, app, api_key: str | None, max_body: int):
        self.app, self.key, self.max_body = app, api_key, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.key is not None:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key.encode()):
                return await error(401, "a missing or wrong API key: send Authorization: Bearer KEY",
                                   "invalid_api_key")(scope, receive, send)
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body:
            return await self._too_large(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":      # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.max_body:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        await error(413, f"the request body is over {self.max_body} bytes", "request_too_large")(scope, receive, send)


def _text_content(content) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = [p.get("text", "") for p in content if isinstance(p, dict)]
    if not all(isinstance(t, str) for t in texts):
        raise RequestError("a content part's text must be a string", code="invalid_type")
    return "".join(texts)
