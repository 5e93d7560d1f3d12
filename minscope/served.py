"""Served simulators: a party played by a model behind an OpenAI-compatible endpoint.

The paper's frozen simulators and evaluation panels are API models. `ServedSpeaker` plays
the partner by sending each live conversation's next turn to a chat-completions endpoint
(vLLM, llama.cpp's server, SGLang, a hosted API, or `python -m minscope.serve`), so a big
simulator never has to be loaded into the training process:

    --simulator openai:MODEL@http://HOST:PORT/v1      (also as a --panel entry)

It speaks the same `respond(episodes, env) -> [Turn]` / `generate` interface as
`rollout.LMSpeaker`, so it can be the Frozen simulator, the base of Verbalized Sampling
(the VS instruction travels in the system message and the candidates are parsed here),
an Ensemble member, the base of Persona-Guided (`ServedPersonaGuided`) or a panel member.
It is never trained: its turns carry no token ids.

The API key is read from MINSCOPE_API_KEY, else OPENAI_API_KEY (none: no Authorization
header, as a local server wants). One turn's requests go out concurrently (asyncio, one
event loop per turn), at most `concurrency` at a time; each has a `timeout` for the whole
exchange, however slowly the server trickles its answer; a 429, a 5xx, a timeout or a
dropped connection is retried `retries` times with exponential backoff (a Retry-After
header is honoured), after which `ServedError` names the endpoint and the last failure. It
is a `RunStopped`: train.py prints it as one line, and the run's last saved step is intact
(`--resume` continues once the endpoint is back); the turn's other requests are cancelled
at once, so the process exits promptly. Other 4xx answers (a wrong model name, a missing
key) are not retried, and neither is an answer that is not a chat completion: every field
read is type-checked (`content` a string or null, `usage` counts whole numbers), and a body
is read up to `MAX_RESPONSE_BYTES` after decompression (a gzip bomb stops there). Defaults
can be changed with MINSCOPE_SERVED_CONCURRENCY (1 or more), MINSCOPE_SERVED_TIMEOUT
(seconds, > 0), MINSCOPE_SERVED_RETRIES (0 or more) and MINSCOPE_SERVED_BACKOFF (seconds);
MINSCOPE_SERVED_EXTRA is a JSON object merged into every request body, e.g.
'{"chat_template_kwargs": {"enable_thinking": false}}' to keep a Qwen3 served by vLLM (or
by minscope.serve) from thinking, as minscope's own speakers do by default.

`usage` counts requests, retries, the endpoint's token usage and latencies;
`take_usage(speakers)` sums and resets it for metrics.jsonl (one record per step).

One file, though long: the request, its retries and the usage counts are one client, read
top to bottom like a small HTTP library.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import random
import re
import threading
import time
import zlib

from .chat import strip_reasoning
from .envs.base import Turn
from .errors import RunStopped
from .stream import view_messages, with_system_suffix

SPEC = re.compile(r"^openai:(?P<model>.+?)@(?P<url>https?://\S+)$")
KEY_VARS = ("MINSCOPE_API_KEY", "OPENAI_API_KEY")
RETRY_STATUS = {408, 409, 429} | set(range(500, 600))
USAGE_KEYS = ("requests", "retries", "prompt_tokens", "completion_tokens", "latency_s", "latency_max_s")
MAX_RESPONSE_BYTES = 8 * 2**20     # a reply of a few hundred tokens is a few KB; more is a broken server


class ServedError(RunStopped):
    """An endpoint kept failing (or refused a request): the run stops, its state intact."""


def is_spec(text) -> bool:
    return isinstance(text, str) and text.startswith("openai:")


def parse_spec(text: str) -> tuple[str, str]:
    """"openai:MODEL@http://HOST:PORT/v1" -> (MODEL, "http://HOST:PORT/v1")."""
    m = SPEC.match(text.strip())
    if not m:
        raise ValueError(f"cannot read simulator {text!r}: write openai:MODEL@http://HOST:PORT/v1 "
                         "(the endpoint's base URL, up to and including /v1)")
    return m["model"], m["url"].rstrip("/")


SETTINGS = {   # name: (environment variable, whole number?, smallest value, what it must be)
    "concurrency": ("MINSCOPE_SERVED_CONCURRENCY", True, 1, "a whole number, 1 or more"),
    "timeout": ("MINSCOPE_SERVED_TIMEOUT", False, 0, "a number of seconds above 0"),
    "retries": ("MINSCOPE_SERVED_RETRIES", True, 0, "a whole number, 0 or more"),
    "backoff": ("MINSCOPE_SERVED_BACKOFF", False, 0, "a number of seconds, 0 or more"),
}


def setting(name: str, value, default):
    """A served-client setting: `value` if given, else its environment variable, else
    `default`; anything that is not a finite number in range stops with one line."""
    var, whole, low, what = SETTINGS[name]
    source = f"{name}={value!r}"
    if value is None:
        text = os.environ.get(var, "").strip()
        if not text:
            return default
        source = f"{var}={text!r}"
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            value = None
    ok = (isinstance(value, int) if whole else isinstance(value, (int, float))) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > low if name == "timeout" else value >= low)
    if not ok:
        raise SystemExit(f"{source}: expected {what}")
    return value


def extra_body() -> dict:
    """MINSCOPE_SERVED_EXTRA: fields added to every request (a JSON object)."""
    text = os.environ.get("MINSCOPE_SERVED_EXTRA", "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise SystemExit(f"MINSCOPE_SERVED_EXTRA={text!r}: expected a JSON object, e.g. "
                         '\'{"chat_template_kwargs": {"enable_thinking": false}}\'')
    return value


def api_key() -> str | None:
    return next((os.environ[k] for k in KEY_VARS if os.environ.get(k)), None)


class ServedSpeaker:
    """A party (the partner by default) played by an OpenAI-compatible endpoint.

    model / base_url: what `parse_spec` reads from the spec. temperature and
    max_new_tokens are sent with every request (`max_tokens`). system_suffix: str or
    episode -> str, appended to the system message (VS instruction, persona).
    """

    served = True          # lets the runner treat it like an LM speaker where that applies

    def __init__(self, model: str, base_url: str, role: str = "partner", temperature: float = 1.0,
                 max_new_tokens: int = 128, name: str | None = None, system_suffix="",
                 concurrency: int | None = None, timeout: float | None = None, retries: int | None = None,
                 backoff: float | None = None, key: str | None = None):
        self.model, self.base_url, self.role = model, base_url.rstrip("/"), role
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.name = name or model
        self.system_suffix = system_suffix
        self.concurrency = setting("concurrency", concurrency, 16)
        self.timeout = setting("timeout", timeout, 120.0)
        self.retries = setting("retries", retries, 4)
        self.backoff = setting("backoff", backoff, 1.0)
        self.max_bytes = MAX_RESPONSE_BYTES
        self.key = key if key is not None else api_key()
        self.extra = extra_body()
        self.usage = _Usage()

    @classmethod
    def from_spec(cls, spec: str, **kwargs) -> "ServedSpeaker":
        model, url = parse_spec(spec)
        return cls(model, url, **kwargs)

    @property
    def endpoint(self) -> str:
        return f"{self.base_url}/chat/completions"

    def derive(self, **changes) -> "ServedSpeaker":
        """A copy with some settings changed (same usage counters)."""
        out = copy.copy(self)
        for k, v in changes.items():
            setattr(out, k, v)
        return out

    # ------------------------------------------------------------------ the speaker interface
    def messages_for(self, env, episode) -> list[dict]:
        return with_system_suffix(view_messages(env, episode, self.role), self.system_suffix, episode)

    def generate(self, episodes, env):
        """One turn for each episode, requested concurrently; returns (texts, ids, logps) like
        `LMSpeaker.generate`, with None for the ids and log-probs (a served turn is never trained on)."""
        texts = self.complete([self.messages_for(env, ep) for ep in episodes])
        return [strip_reasoning(t) for t in texts], [None] * len(texts), [None] * len(texts)

    def respond(self, episodes, env) -> list[Turn]:
        texts, _, _ = self.generate(episodes, env)
        return [Turn(role=self.role, text=t) for t in texts]

    def assign(self, episodes):
        for ep in episodes:
            ep.partner_name = self.name

    # ------------------------------------------------------------------ HTTP
    def complete(self, conversations: list[list[dict]]) -> list[str]:
        """The endpoint's reply to each conversation, at most `concurrency` requests in flight.
        The first request that fails for good cancels the others (nothing is left running)."""
        if not conversations:
            return []
        return _run(self._complete(conversations))

    async def _complete(self, conversations):
        import httpx

        headers = {"Accept-Encoding": "gzip, deflate"}       # the encodings _read_body decodes
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        gate = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(headers=headers, timeout=self.timeout, limits=limits) as client:
            async def one(messages):
                async with gate:
                    return await self._request(client, messages)
            tasks = [asyncio.ensure_future(one(m)) for m in conversations]
            try:
                return await asyncio.gather(*tasks)
            finally:   # after a failure (or Ctrl-C) the requests still running or waiting are dropped
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _request(self, client, messages: list[dict]) -> str:
        import httpx

        body = {**self.extra, "model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_new_tokens}
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.usage.add(retries=1)
            t0 = time.perf_counter()
            try:   # the deadline covers the whole exchange: connecting, headers and every body byte
                status, headers, data = await asyncio.wait_for(self._post(client, body), self.timeout)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                last, wait = f"no answer within {self.timeout:g} s", None
            except httpx.TransportError as e:
                last, wait = f"{type(e).__name__}: {e}", None
            else:
                if status == 200:
                    return self._read(data, time.perf_counter() - t0)
                last = f"HTTP {status}: {_snippet(data)}"
                if status not in RETRY_STATUS:
                    raise ServedError(f"simulator endpoint {self.endpoint} (model {self.model!r}) refused the "
                                      f"request: {last}")
                wait = _retry_after(headers)
            if attempt < self.retries:
                await asyncio.sleep(wait if wait is not None else self.backoff * 2 ** attempt * (1 + random.random() / 4))
        raise ServedError(f"simulator endpoint {self.endpoint} (model {self.model!r}) failed "
                          f"{self.retries + 1} times; the last failure: {last}")

    async def _post(self, client, body):
        """(status, headers, body bytes) of one POST, the body read up to `max_bytes`."""
        async with client.stream("POST", self.endpoint, json=body) as resp:
            return resp.status_code, resp.headers, await self._read_body(resp)

    async def _read_body(self, resp) -> bytes:
        """The decoded body, decompressed piece by piece so that no more than `max_bytes`
        (+1) is ever held: a small compressed body can expand a thousandfold."""
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity", "gzip", "x-gzip", "deflate"):
            raise ServedError(f"simulator endpoint {self.endpoint} answered in an encoding it was not asked "
                              f"for ({encoding!r})")
        inflate = None if encoding in ("", "identity") else zlib.decompressobj(wbits=47)   # gzip or zlib header
        out = bytearray()

        def add(piece: bytes):
            out.extend(piece)
            if len(out) > self.max_bytes:
                raise ServedError(f"simulator endpoint {self.endpoint} answered more than {self.max_bytes} bytes "
                                  "(decoded); a chat completion is far smaller")
        try:
            async for chunk in resp.aiter_raw():
                while chunk:
                    if inflate is None:
                        add(chunk)
                        break
                    add(inflate.decompress(chunk, self.max_bytes - len(out) + 1))
                    chunk = inflate.unconsumed_tail
            if inflate is not None:
                add(inflate.flush())
        except zlib.error as e:
            raise ServedError(f"simulator endpoint {self.endpoint} answered a damaged {encoding} body ({e})") from None
        return bytes(out)

    def _read(self, data: bytes, seconds: float) -> str:
        """The reply text of a chat completion; anything else stops the run, naming the endpoint."""
        try:
            text, usage, why = _completion(json.loads(data))
        except (ValueError, RecursionError):       # not JSON, or nested deeper than Python recurses
            text, usage, why = "", (0, 0), "not JSON"
        if why:
            raise ServedError(f"simulator endpoint {self.endpoint} answered without a chat completion ({why}): "
                              f"{_snippet(data)}")
        self.usage.add(requests=1, prompt_tokens=usage[0], completion_tokens=usage[1], latency_s=seconds,
                       latency_max_s=seconds)
        return text


def _completion(obj) -> tuple[str, tuple[int, int], str | None]:
    """(reply text, (prompt, completion) tokens, None) of a parsed chat completion, or
    ("", (0, 0), what is wrong with it)."""
    bad = "", (0, 0)
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return *bad, "no choices"
    message = choices[0].get("message")
    if not isinstance(message, dict):
        return *bad, "choices[0].message is not an object"
    text = message.get("content")
    if text is not None and not isinstance(text, str):
        return *bad, f"choices[0].message.content is {_kind(text)}, not a string"
    if text is not None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:             # as the server refuses such a message
            return *bad, "choices[0].message.content is not valid Unicode (a lone UTF-16 surrogate, such as \\ud800)"
    usage = obj.get("usage")
    if usage is None:
        usage = {}
    if not isinstance(usage, dict):
        return *bad, f"usage is {_kind(usage)}, not an object"
    counts = []
    for key in ("prompt_tokens", "completion_tokens"):
        n = usage.get(key)
        n = 0 if n is None else n
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return *bad, f"usage.{key} is {n!r}, not a count"
        counts.append(n)
    return text or "", tuple(counts), None


def _kind(value) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__)


def _run(coro):
    """Run `coro` to the end on an event loop of its own (on a thread of its own where this
    thread already runs one, as a notebook's does)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
    thread = threading.Thread(target=target, daemon=True, name="minscope-served")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class ServedPersonaGuided(ServedSpeaker):
    """Persona-Guided with a served base: a persona drawn per rollout group from a bank is
    appended to the system message (the same draw as `simulators.PersonaGuided`)."""

    def __init__(self, base: ServedSpeaker, personas: list[str], seed: int = 0, name: str = "persona"):
        if not personas:
            raise ValueError("PersonaGuided needs a non-empty persona bank from the environment")
        self.__dict__.update(base.derive().__dict__)
        self.name, self.personas, self.rng = name, personas, random.Random(seed)
        self.system_suffix = lambda ep: "Play this person:\n" + ep.info["persona"]

    def assign(self, episodes):
        from .simulators import PersonaGuided

        PersonaGuided.assign(self, episodes)


class _Usage:
    """Counters shared by a speaker and its copies (threads add to them concurrently)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.values = dict.fromkeys(USAGE_KEYS, 0)

    def add(self, **counts):
        with self.lock:
            for k, v in counts.items():
                self.values[k] = max(self.values[k], v) if k.endswith("_max_s") else self.values[k] + v

    def __deepcopy__(self, memo):      # evaluation's isolated_rng copies speakers' attributes
        return self


def served_speakers(*roots) -> list[ServedSpeaker]:
    """Every ServedSpeaker reachable from `roots` (also inside Verbalized / Ensemble)."""
    found, todo = [], list(roots)
    while todo:
        s = todo.pop()
        if s is None or any(s is f for f in found):
            continue
        if isinstance(s, (list, tuple)):
            todo += list(s)
            continue
        found.append(s)
        todo += [getattr(s, "speaker", None), *getattr(s, "members", [])]
    return [s for s in found if isinstance(s, ServedSpeaker)]


def take_usage(speakers) -> dict:
    """The served_* metrics since the last call, summed over `speakers` (counters shared by
    copies are counted once), and reset: requests, retries, prompt/completion tokens, mean
    and max latency per request. Empty when no served simulator took part."""
    counters = {id(s.usage): s.usage for s in speakers}.values()
    if not counters:
        return {}
    total = dict.fromkeys(USAGE_KEYS, 0)
    for c in counters:
        with c.lock:
            for k, v in c.values.items():
                total[k] = max(total[k], v) if k.endswith("_max_s") else total[k] + v
            c.reset()
    total["latency_s"] = total["latency_s"] / total["requests"] if total["requests"] else 0.0
    return {f"served_{k}": v for k, v in total.items()}


def _snippet(data: bytes, limit: int = 200) -> str:
    text = " ".join(data[:4 * limit].decode("utf-8", "replace").split())
    return text[:limit] + ("..." if len(text) > limit else "") if text else "(empty body)"


def _retry_after(headers) -> float | None:
    value = headers.get("retry-after")
    try:
        wait = float(value) if value is not None else None
    except ValueError:
        return None
    return min(60.0, max(0.0, wait)) if wait is not None and math.isfinite(wait) else None
