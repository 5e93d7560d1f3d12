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
header, as a local server wants). One turn's requests go out concurrently, at most
`concurrency` at a time; each has a `timeout`; a 429, a 5xx, a timeout or a dropped
connection is retried `retries` times with exponential backoff (a Retry-After header is
honoured), after which `ServedError` names the endpoint and the last failure. It is a
`RunStopped`: train.py prints it as one line, and the run's last saved step is intact
(`--resume` continues once the endpoint is back). Other 4xx answers (a wrong model name,
a missing key) are not retried. Defaults can be changed with MINSCOPE_SERVED_CONCURRENCY,
MINSCOPE_SERVED_TIMEOUT, MINSCOPE_SERVED_RETRIES and MINSCOPE_SERVED_BACKOFF;
MINSCOPE_SERVED_EXTRA is a JSON object merged into every request body, e.g.
'{"chat_template_kwargs": {"enable_thinking": false}}' to keep a Qwen3 served by vLLM (or
by minscope.serve) from thinking, as minscope's own speakers do by default.

`usage` counts requests, retries, the endpoint's token usage and latencies;
`take_usage(speakers)` sums and resets it for metrics.jsonl (one record per step).
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .chat import strip_reasoning
from .envs.base import Turn
from .errors import RunStopped
from .rollout import view_messages, with_system_suffix

SPEC = re.compile(r"^openai:(?P<model>.+?)@(?P<url>https?://\S+)$")
KEY_VARS = ("MINSCOPE_API_KEY", "OPENAI_API_KEY")
RETRY_STATUS = {408, 409, 429} | set(range(500, 600))
USAGE_KEYS = ("requests", "retries", "prompt_tokens", "completion_tokens", "latency_s", "latency_max_s")


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


def _env_number(name: str, default, kind=float):
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return kind(value)
    except ValueError:
        raise SystemExit(f"{name}={value!r}: expected a number") from None


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
        self.concurrency = concurrency or _env_number("MINSCOPE_SERVED_CONCURRENCY", 16, int)
        self.timeout = timeout or _env_number("MINSCOPE_SERVED_TIMEOUT", 120.0)
        self.retries = retries if retries is not None else _env_number("MINSCOPE_SERVED_RETRIES", 4, int)
        self.backoff = backoff if backoff is not None else _env_number("MINSCOPE_SERVED_BACKOFF", 1.0)
        self.key = key if key is not None else api_key()
        self.extra = extra_body()
        self.usage = _Usage()
        self._client = None

    @classmethod
    def from_spec(cls, spec: str, **kwargs) -> "ServedSpeaker":
        model, url = parse_spec(spec)
        return cls(model, url, **kwargs)

    @property
    def endpoint(self) -> str:
        return f"{self.base_url}/chat/completions"

    def derive(self, **changes) -> "ServedSpeaker":
        """A copy with some settings changed (same HTTP client and usage counters)."""
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
    def client(self):
        if self._client is None:
            import httpx

            headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
            limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
            self._client = httpx.Client(headers=headers, timeout=self.timeout, limits=limits)
        return self._client

    def complete(self, conversations: list[list[dict]]) -> list[str]:
        """The endpoint's reply to each conversation, at most `concurrency` requests in flight."""
        if not conversations:
            return []
        if len(conversations) == 1:
            return [self._request(conversations[0])]
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations)))
        try:
            return list(pool.map(self._request, conversations))
        finally:   # after a failure (or Ctrl-C) the requests not yet sent are dropped
            pool.shutdown(wait=False, cancel_futures=True)

    def _request(self, messages: list[dict]) -> str:
        import httpx

        body = {**self.extra, "model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_new_tokens}
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.usage.add(retries=1)
            t0 = time.perf_counter()
            try:
                resp = self.client().post(self.endpoint, json=body)
            except httpx.TimeoutException:
                last, wait = f"no answer within {self.timeout:g} s", None
            except httpx.TransportError as e:
                last, wait = f"{type(e).__name__}: {e}", None
            else:
                if resp.status_code == 200:
                    return self._read(resp, time.perf_counter() - t0)
                last = f"HTTP {resp.status_code}: {_snippet(resp)}"
                if resp.status_code not in RETRY_STATUS:
                    raise ServedError(f"simulator endpoint {self.endpoint} (model {self.model!r}) refused the "
                                      f"request: {last}")
                wait = _retry_after(resp)
            if attempt < self.retries:
                time.sleep(wait if wait is not None else self.backoff * 2 ** attempt * (1 + random.random() / 4))
        raise ServedError(f"simulator endpoint {self.endpoint} (model {self.model!r}) failed "
                          f"{self.retries + 1} times; the last failure: {last}")

    def _read(self, resp, seconds: float) -> str:
        try:
            data = resp.json()
            text = data["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError):
            raise ServedError(f"simulator endpoint {self.endpoint} answered without a chat completion: "
                              f"{_snippet(resp)}") from None
        usage = data.get("usage") or {}
        self.usage.add(requests=1, prompt_tokens=usage.get("prompt_tokens", 0) or 0,
                       completion_tokens=usage.get("completion_tokens", 0) or 0, latency_s=seconds,
                       latency_max_s=seconds)
        return text

    def __getstate__(self):        # the HTTP client and its lock are not copied across processes
        state = dict(self.__dict__)
        state["_client"] = None
        return state


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


def _snippet(resp, limit: int = 200) -> str:
    try:
        text = resp.text
    except Exception:  # noqa: BLE001 - a body that cannot be decoded
        text = ""
    text = " ".join(text.split())
    return text[:limit] + ("..." if len(text) > limit else "") if text else "(empty body)"


def _retry_after(resp) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return min(60.0, max(0.0, float(value))) if value is not None else None
    except ValueError:
        return None
