"""Serve a minscope simulator over the OpenAI chat-completions protocol.

A simulator co-trained here (or the Verbalized Sampling wrapper around a frozen one) is what
other agent-RL stacks lack: their user simulators are frozen prompts. Served at an
OpenAI-compatible base URL it plugs into tau2's user simulator, or any tool that takes one:

    python -m minscope.serve runs/p4g-cotrain --adapter simulator            latest simulator-step*/
    python -m minscope.serve runs/p4g-cotrain --adapter simulator --step 64
    python -m minscope.serve runs/p4g-population --adapter pool2             a snapshot of the pool (state.pt)
    python -m minscope.serve runs/p4g-vs --adapter policy --step best
    python -m minscope.serve Qwen/Qwen3-1.7B --vs                            a base model, VS-wrapped

    POST /v1/chat/completions   {"model", "messages", "temperature", "max_tokens", "n"}  (no streaming)
    GET  /v1/models

With --vs the server is the VS simulator: the VS instruction is appended to the system
message, k candidates with probabilities are generated and one reply is drawn (parse
failures are regenerated twice, then the raw text is used), so the client sees a plain chat
model. Concurrent requests are batched: a worker thread takes every request waiting (up
to --max-batch) and generates them in one `rollout.sample` call per temperature (left
padding, EOS-aware decode). A request's `seed` is not honoured (rows share a batch).
FastAPI + uvicorn: a standard, well-kept ASGI stack; one process holds the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import random
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from .chat import chat_format, strip_reasoning
from .rollout import eos_token_ids, sample
from . import verbalized


# --------------------------------------------------------------------------- loading
def latest_step(run_dir: Path, prefix: str) -> int | None:
    head = f"{prefix}-step"
    steps = [int(p.name[len(head):]) for p in run_dir.glob(f"{head}*") if p.name[len(head):].isdigit()]
    return max(steps) if steps else None


def load_target(target: str, adapter: str | None = None, step: str | None = None):
    """(model, tokenizer, adapter slot or None, description) for a run folder's adapter
    (policy | simulator | poolK) or a base model by name or path."""
    from .files import load_state, read_json
    from .models import load_adapter_state, load_model
    from .runner import _attach_adapter, adapter_folder
    from .served import is_spec

    run_dir = Path(target)
    if not (run_dir / "config.json").is_file():
        if adapter:
            raise SystemExit(f"--adapter {adapter}: {target} is not a run folder (no config.json); "
                             "serve a base model without --adapter, or pass a folder written by train.py")
        model, tok = load_model(target)
        return model, tok, None, f"base model {target}"
    cfg = read_json(run_dir / "config.json")
    if "models" in cfg:
        raise SystemExit(f"{run_dir} is a toy run; its tiny models are not chat models and are not served")
    adapter = adapter or "simulator"
    pool = adapter.startswith("pool") and adapter[4:].isdigit()
    if adapter not in ("policy", "simulator") and not pool:
        raise SystemExit(f"--adapter {adapter!r}: choose policy, simulator or poolK (a snapshot of a "
                         "Population run's pool, K from 0)")
    base = cfg["policy"] if adapter == "policy" else (cfg.get("simulator") or cfg["policy"])
    if is_spec(base):
        raise SystemExit(f"{run_dir} trained against a served simulator ({base}); serve that endpoint itself")
    prefix = "policy" if adapter == "policy" else "simulator"
    if step in (None, "latest"):
        n = latest_step(run_dir, prefix)
    elif step == "best":
        n = json.loads((run_dir / "best.json").read_text())["step"] if (run_dir / "best.json").is_file() else None
    elif str(step).isdigit():
        n = int(step)
    else:
        raise SystemExit(f"--step must be latest, best or a step number, not {step!r}")
    folder = adapter_folder(str(run_dir / f"{prefix}-step{n}")) if n is not None else None
    if folder is None:
        trains = prefix == "policy" or cfg.get("method") in ("cotrain", "population")
        raise SystemExit(f"{run_dir} has no {prefix}-step{'*' if n is None else n}/ adapter ("
                         + ("adapters are saved at every --eval-every step)" if trains else
                            f"--method {cfg.get('method')} does not train a simulator; serve its base model)"))
    model, tok = load_model(base, load_in_4bit=bool(cfg.get("load_in_4bit")))
    model = _attach_adapter(model, "served", folder)
    what = f"{run_dir} {prefix}-step{n}"
    if pool:
        k = int(adapter[4:])
        state = load_state(run_dir / "state.pt") if (run_dir / "state.pt").is_file() else {}
        snapshots = state.get("partner", {}).get("pool", [])
        if k >= len(snapshots):
            raise SystemExit(f"{run_dir}: the pool holds {len(snapshots)} snapshot(s) in state.pt; "
                             f"--adapter {adapter} needs at least {k + 1}")
        snap_step, weights = snapshots[k]
        load_adapter_state(model, "served", weights)
        what = f"{run_dir} pool snapshot {k} (step {snap_step})"
    return model, tok, "served", what


# --------------------------------------------------------------------------- batching
@dataclass
class Job:
    messages: list[dict]
    temperature: float
    max_tokens: int
    n: int = 1
    thinking: bool = False
    future: Future = field(default_factory=Future)


class Generator:
    """One model behind a queue: a worker thread generates every waiting job in one batch."""

    def __init__(self, model, tokenizer, adapter: str | None = None, vs_k: int | None = None,
                 max_batch: int = 32, max_context: int | None = None, seed: int = 0):
        self.model, self.tokenizer, self.adapter = model, tokenizer, adapter
        self.vs_k, self.max_batch = vs_k, max_batch
        self.eos = eos_token_ids(tokenizer, model)
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", None)
        self.rng = random.Random(seed)
        self.batches = 0                   # how many batches were generated (tests, logs)
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="minscope-serve").start()

    def submit(self, job: Job) -> Future:
        self.queue.put(job)
        return job.future

    def _loop(self):
        while True:
            jobs = [self.queue.get()]
            while len(jobs) < self.max_batch:
                try:
                    jobs.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            try:
                results = self.run(jobs)
            except Exception as e:  # noqa: BLE001 - answered to every waiting request
                for job in jobs:
                    job.future.set_exception(e)
                continue
            for job, result in zip(jobs, results):
                job.future.set_result(result)

    def prompt(self, job: Job) -> list[int]:
        messages = [dict(m) for m in job.messages]
        if self.vs_k:
            block = verbalized.vs_instruction(self.vs_k)
            if messages and messages[0]["role"] == "system":
                messages[0]["content"] = messages[0]["content"] + "\n\n" + block
            else:
                messages.insert(0, {"role": "system", "content": block})
        text = chat_format(self.tokenizer, job.thinking).render(messages)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _sample(self, rows: list[tuple[list[int], float, int]]):
        """rows: (prompt ids, temperature, max tokens) -> [(ids, finished)] in order; one
        `sample` call per temperature."""
        from .models import use_adapter

        out = [None] * len(rows)
        for temp in sorted({t for _, t, _ in rows}):
            idx = [i for i, r in enumerate(rows) if r[1] == temp]
            cap = max(rows[i][2] for i in idx)
            with use_adapter(self.model, self.adapter):
                ids, _ = sample(self.model, [rows[i][0] for i in idx], self.tokenizer.pad_token_id, self.eos,
                                cap, temperature=temp)
            self.batches += 1
            for i, gen in zip(idx, ids):
                gen = gen[:rows[i][2]]
                out[i] = (gen, bool(gen) and gen[-1] in self.eos)
        return out

    def _text(self, gen: list[int], ended: bool) -> str:
        return self.tokenizer.decode(gen[:-1] if ended else gen, skip_special_tokens=True)

    @torch.no_grad()
    def run(self, jobs: list[Job]) -> list[dict]:
        """Each job's choices and token usage."""
        rows, owner = [], []
        for j, job in enumerate(jobs):
            ids = self.prompt(job)
            cap = job.max_tokens * (self.vs_k + 1) if self.vs_k else job.max_tokens
            if self.max_context and len(ids) + cap > self.max_context:
                cap = max(1, self.max_context - len(ids))
            for _ in range(job.n):
                rows.append((ids, job.temperature, cap))
                owner.append(j)
        results = self._sample(rows)
        usage = [{"prompt_tokens": len(row[0]), "completion_tokens": 0} for row in rows]
        choices: list[tuple[str, str]] = []
        for r, (gen, ended) in enumerate(results):
            usage[r]["completion_tokens"] += len(gen)
            choices.append((self._text(gen, ended), "stop" if ended else "length"))
        if self.vs_k:
            choices = self._verbalize(rows, choices, usage)
        out = [{"choices": [], "prompt_tokens": 0, "completion_tokens": 0} for _ in jobs]
        for r, j in enumerate(owner):
            text, reason = choices[r]
            out[j]["choices"].append({"index": len(out[j]["choices"]),
                                      "message": {"role": "assistant", "content": strip_reasoning(text)},
                                      "finish_reason": reason})
            out[j]["prompt_tokens"] = usage[r]["prompt_tokens"]
            out[j]["completion_tokens"] += usage[r]["completion_tokens"]
        return out

    def _verbalize(self, rows, raw, usage, retries: int = 2):
        """Draw one reply from each row's candidates; unparsable rows are generated again."""
        out: list = [None] * len(rows)
        todo = list(range(len(rows)))
        for attempt in range(retries + 1):
            failed = []
            for r in todo:
                reply, _, _ = verbalized.pick(raw[r][0], self.rng)
                if reply is None:
                    failed.append(r)
                else:
                    out[r] = (reply, "stop")
            todo = failed
            if not todo or attempt == retries:
                break
            again = self._sample([rows[r] for r in todo])
            for r, (gen, ended) in zip(todo, again):
                usage[r]["completion_tokens"] += len(gen)
                raw[r] = (self._text(gen, ended), "stop" if ended else "length")
        for r in todo:
            out[r] = (verbalized.fallback(raw[r][0]), raw[r][1])
        return out


# --------------------------------------------------------------------------- the app
class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list | None = None


class ChatRequest(BaseModel):
    """The fields of an OpenAI chat-completions request that are read; others are ignored."""
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[Message]
    temperature: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stream: bool = False
    chat_template_kwargs: dict | None = None


def build_app(generator: Generator, name: str, max_tokens: int = 512):
    """The FastAPI app serving `generator` as model `name`."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(title=f"minscope simulator {name}")
    created = int(time.time())

    def error(status: int, message: str, code: str | None = None):
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": code}},
                            status_code=status)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "minscope"}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        if req.model != name:
            return error(404, f"the model {req.model!r} does not exist; this server serves {name!r}",
                         "model_not_found")
        if req.stream:
            return error(400, "streaming is not supported by minscope.serve; send stream: false")
        if not 1 <= req.n <= 16:
            return error(400, f"n must be between 1 and 16, not {req.n}")
        if not req.messages:
            return error(400, "messages must hold at least one message")
        temperature = 1.0 if req.temperature is None else req.temperature
        if not 0 <= temperature <= 10:
            return error(400, f"temperature must be between 0 and 10, not {temperature}")
        cap = req.max_completion_tokens or req.max_tokens or max_tokens
        if cap < 1:
            return error(400, f"max_tokens must be at least 1, not {cap}")
        messages = [{"role": m.role, "content": _text_content(m.content)} for m in req.messages]
        thinking = bool((req.chat_template_kwargs or {}).get("enable_thinking", False))
        job = Job(messages, temperature, min(cap, max_tokens), req.n, thinking)
        result = await asyncio.wrap_future(generator.submit(job))
        prompt, completion = result["prompt_tokens"], result["completion_tokens"]
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": name, "choices": result["choices"],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}

    return app


def _text_content(content) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minscope.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="a run folder written by train.py, or a base model (hub name or path)")
    p.add_argument("--adapter", help="run folders: policy | simulator (default) | poolK (Population pool snapshot K)")
    p.add_argument("--step", help="run folders: latest (default) | best | a step number of the saved adapters")
    p.add_argument("--vs", action="store_true", help="serve the Verbalized Sampling wrapper: k candidates, one drawn")
    p.add_argument("--vs-k", type=int, default=5, help="--vs: candidates per reply (default 5, the paper's)")
    p.add_argument("--name", help="the model name clients ask for (default: the run folder's or model's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=32, help="requests generated in one batch (default 32)")
    p.add_argument("--max-tokens", type=int, default=512, help="cap on max_tokens per reply (default 512)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler and of the VS draws")
    return p.parse_args(argv)


def make_server(argv=None):
    """The uvicorn server of the command line `argv` (model loaded, not yet listening), and
    the line that says what it serves."""
    import uvicorn

    args = parse_args(argv)
    if args.vs_k < 1 or args.max_batch < 1 or args.max_tokens < 1:
        raise SystemExit("--vs-k, --max-batch and --max-tokens must be 1 or more")
    torch.manual_seed(args.seed)
    model, tok, adapter, what = load_target(args.target, args.adapter, args.step)
    model.eval()
    name = args.name or (Path(args.target).name + (f"-{args.adapter}" if args.adapter else "")
                         + ("-vs" if args.vs else ""))
    gen = Generator(model, tok, adapter, vs_k=args.vs_k if args.vs else None, max_batch=args.max_batch,
                    seed=args.seed)
    app = build_app(gen, name, args.max_tokens)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    server.generator = gen
    banner = (f"serving {what}{' (Verbalized Sampling, k=' + str(args.vs_k) + ')' if args.vs else ''} as model "
              f"{name!r} at http://{args.host}:{args.port}/v1")
    return server, banner


def main(argv=None):
    from .models import quiet

    quiet()
    server, banner = make_server(argv)
    print(banner, flush=True)
    server.run()


if __name__ == "__main__":
    main()
