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
to --max-batch) and generates them in one `sampling.sample` call per temperature (left
padding, EOS-aware decode). A request's `seed` is not honoured (rows share a batch).
FastAPI + uvicorn: a standard, well-kept ASGI stack; one process holds the model (the HTTP
side, routes and request checks, is minscope/serve_app.py).

Requests are checked one by one, so a bad one gets its own 4xx and the rest of its batch is
served: the body is at most --max-body-bytes, at most --max-messages messages, n at most 16,
and the prompt shorter than the model's context (413 / 400 `context_length_exceeded`; a reply
is cut to fit what is left). Fields are typed as the OpenAI API types them, strictly: a
string where a number or a boolean belongs (`"enable_thinking": "no"`) is a 400, not a guess;
`max_tokens` must be 1 or more (0 is a 400, as OpenAI answers it); a temperature under 1e-5 is
greedy; a lone UTF-16 surrogate in a message is a 400. If generating a batch fails anyway,
each of its requests is generated alone, so a failure stays with the request that caused it,
and the batching thread outlives anything a request does (a client that goes away included).
A server listening beyond this machine (--host other than a loopback address) needs
--api-key KEY (or MINSCOPE_API_KEY, which is also what minscope's client sends as its key):
every request must then carry `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import queue
import random
import threading
from concurrent.futures import Future
from pathlib import Path

import torch

from . import verbalized
from .chat import chat_format, strip_reasoning
from .sampling import eos_token_ids, sample
from .serve_app import MAX_BODY_BYTES, MAX_MESSAGES, Job, RequestError, build_app


# --------------------------------------------------------------------------- loading
def latest_step(run_dir: Path, prefix: str) -> int | None:
    head = f"{prefix}-step"
    steps = [int(p.name[len(head):]) for p in run_dir.glob(f"{head}*") if p.name[len(head):].isdigit()]
    return max(steps) if steps else None


def is_run_folder(path: Path) -> bool:
    """Whether `path` is a folder train.py wrote: its config.json holds train.py's settings (a
    real run's "env" and "policy", a toy run's "models"). A saved Hugging Face model has a
    config.json too, with "model_type" and none of those: it is a base model to serve."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(cfg, dict) and "model_type" not in cfg and (
        ("env" in cfg and "policy" in cfg) or "models" in cfg)


def load_target(target: str, adapter: str | None = None, step: str | None = None):
    """(model, tokenizer, adapter slot or None, description) for a run folder's adapter
    (policy | simulator | poolK) or a base model by name or path."""
    from .adapters import load_adapter_state
    from .files import load_state, read_json
    from .models import load_model
    from .real_models import _attach_adapter, adapter_folder
    from .served import is_spec

    run_dir = Path(target)
    if not is_run_folder(run_dir):
        if adapter:
            raise SystemExit(f"--adapter {adapter}: {target} is not a run folder (no config.json of train.py's); "
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
MIN_TEMPERATURE = 1e-5      # below it, sampling is greedy (logits / 5e-324 overflow to inf)


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
        while True:      # nothing a request does ends this thread
            try:
                self._serve_batch()
            except Exception as e:  # noqa: BLE001 - a bug of ours: say so, keep serving
                print(f"minscope.serve: a batch failed ({type(e).__name__}: {e})", flush=True)

    def _serve_batch(self):
        jobs = [self.queue.get()]
        while len(jobs) < self.max_batch:
            try:
                jobs.append(self.queue.get_nowait())
            except queue.Empty:
                break
        # a request whose client went away was cancelled while it waited: drop it; the others
        # are now running, and can no longer be cancelled under us
        jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        try:
            outcomes = self.answer(jobs)
        except Exception as e:  # noqa: BLE001 - whatever it is, every waiting request hears of it
            outcomes = [e] * len(jobs)
        for job, outcome in zip(jobs, outcomes):
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

    def answer(self, jobs: list[Job]) -> list:
        """Each job's result, or the exception that is its answer. Prompts are checked one by
        one; the good ones are generated in one batch, and if that fails, each alone."""
        out: list = [None] * len(jobs)
        ready = []
        for i, job in enumerate(jobs):
            try:
                job.ids = self.checked_prompt(job)
                ready.append(i)
            except Exception as e:  # noqa: BLE001 - that request's own answer
                out[i] = e
        if not ready:
            return out
        try:
            results = self.run([jobs[i] for i in ready])
        except Exception:  # noqa: BLE001 - find the request that breaks it
            results = []
            for i in ready:
                try:
                    results += self.run([jobs[i]])
                except Exception as e:  # noqa: BLE001
                    results.append(e)
        for i, result in zip(ready, results):
            out[i] = result
        return out

    def checked_prompt(self, job: Job) -> list[int]:
        """The job's prompt ids; a prompt that fills the model's context is refused, and so
        are messages the chat template or the tokenizer cannot take (the request's doing)."""
        try:
            ids = self.prompt(job)
        except Exception as e:  # noqa: BLE001 - jinja's and the tokenizer's errors vary
            raise RequestError(f"the messages cannot be formatted for this model ({type(e).__name__}: "
                               f"{str(e)[:200]})") from None
        if self.max_context and len(ids) >= self.max_context:
            raise RequestError(f"this model's context is {self.max_context} tokens; the messages are "
                               f"{len(ids)} tokens. Shorten them", code="context_length_exceeded")
        return ids

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
        from .adapters import use_adapter

        out = [None] * len(rows)
        for temp in sorted({t for _, t, _ in rows}):
            idx = [i for i, r in enumerate(rows) if r[1] == temp]
            cap = max(rows[i][2] for i in idx)
            with use_adapter(self.model, self.adapter):
                # share_prefix: the rows of one group share their system prompt and persona
                ids, _ = sample(self.model, [rows[i][0] for i in idx], self.tokenizer.pad_token_id, self.eos,
                                cap, temperature=temp if temp >= MIN_TEMPERATURE else 0.0, share_prefix=True)
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
            ids = job.ids if job.ids is not None else self.prompt(job)
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


# --------------------------------------------------------------------------- the command line
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
    p.add_argument("--max-messages", type=int, default=MAX_MESSAGES,
                   help=f"most messages in one request (default {MAX_MESSAGES})")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help=f"largest request body (default {MAX_BODY_BYTES})")
    p.add_argument("--api-key", default=os.environ.get("MINSCOPE_API_KEY") or None,
                   help="the key every request must carry (Authorization: Bearer KEY); needed for a --host "
                        "that is not a loopback address (default: $MINSCOPE_API_KEY)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler and of the VS draws")
    return p.parse_args(argv)


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False       # a host name (or 0.0.0.0, every interface): not known to be local


def make_server(argv=None):
    """The uvicorn server of the command line `argv` (model loaded, not yet listening), and
    the line that says what it serves."""
    import uvicorn

    args = parse_args(argv)
    if min(args.vs_k, args.max_batch, args.max_tokens, args.max_messages, args.max_body_bytes) < 1:
        raise SystemExit("--vs-k, --max-batch, --max-tokens, --max-messages and --max-body-bytes must be 1 or more")
    if not is_loopback(args.host) and not args.api_key:
        raise SystemExit(f"--host {args.host} listens beyond this machine: give --api-key KEY (or set "
                         "MINSCOPE_API_KEY), which every client must then send")
    torch.manual_seed(args.seed)
    model, tok, adapter, what = load_target(args.target, args.adapter, args.step)
    model.eval()
    name = args.name or (Path(args.target).name + (f"-{args.adapter}" if args.adapter else "")
                         + ("-vs" if args.vs else ""))
    gen = Generator(model, tok, adapter, vs_k=args.vs_k if args.vs else None, max_batch=args.max_batch,
                    seed=args.seed)
    app = build_app(gen, name, args.max_tokens, api_key=args.api_key, max_body=args.max_body_bytes,
                    max_messages=args.max_messages)
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
    # run the imported module, not this `__main__` copy: its Generator must be the class the
    # app (serve_app) was built with
    from minscope.serve import main as serve_main
    serve_main()
