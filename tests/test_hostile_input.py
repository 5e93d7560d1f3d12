"""Hostile input to the server, the served client, the run lock and the trainer.
The hostile-input cases failed on the code before the fix, with a traceback, a 500
for a whole batch, a dead thread, a hang, a wrong number or two holders of one lock (each
test's docstring says how); a few neighbours (n 17, an unknown model, temperature 11) held
already and guard the checks that replaced them."""
import gzip
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from minscope import files
from minscope.adapters import add_adapters
from minscope.envs.wordgame import Asker, WordGame
from minscope.methods import build_method
from minscope.models import build_tiny_model
from minscope.rollout import LMSpeaker, rollout
from minscope.runfolder import FORMAT_VERSION
from minscope.served import ServedError, ServedSpeaker
from minscope.trainer import UpdateConfig, grpo_update

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- 14. the run lock
def _contend(run_dir, barrier, holders, trials):
    """One of several processes: every trial, all try to take a fresh (or stale) lock at once;
    the winners hold it until every process has tried."""
    for t in range(trials):
        folder = os.path.join(run_dir, str(t))
        barrier.wait()
        lock = files.RunLock(folder, warn=lambda msg: None)
        try:
            lock.acquire()
            with holders.get_lock():
                holders[t] += 1
        except SystemExit:
            pass
        barrier.wait()                 # everyone has tried: the holder lets go
        if lock.held:
            lock.release()
        barrier.wait()


def test_at_most_one_of_several_racing_processes_holds_the_lock(tmp_path):
    """4 processes x 100 trials, every other one against a stale lock (a dead pid). Before
    (an empty lock file, the pid written after): two holders in 2-15 of 100 trials."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    procs, trials = 4, 100
    for t in range(trials):
        (tmp_path / str(t)).mkdir()
        if t % 2:
            (tmp_path / str(t) / "lock").write_text(f"{dead.pid}\n")
    ctx = multiprocessing.get_context("fork")
    barrier, holders = ctx.Barrier(procs), ctx.Array("i", trials)
    workers = [ctx.Process(target=_contend, args=(str(tmp_path), barrier, holders, trials))
               for _ in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert all(w.exitcode == 0 for w in workers)
    twice = sum(h > 1 for h in holders)
    assert twice == 0, f"two or more holders in {twice} of {trials} trials"
    assert list(holders) == [1] * trials                    # and a holder every time
    assert not any((tmp_path / str(t) / "lock").exists() for t in range(trials))


# --------------------------------------------------------------------------- 15. trainer statistics
def test_statistics_average_the_epochs_applied_not_the_skipped_one(tokenizer):
    """Two epochs at lr 0 (the weights never move, so both epochs see the same entropy); the
    first epoch's gradient is made infinite, so it is skipped. The logged entropy is the one
    epoch's entropy. Before: halved (divided by both epochs), enough for a false alarm."""
    torch.manual_seed(0)
    model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32), ["policy"], init_lora_weights=False)
    policy = LMSpeaker(model, tokenizer, "agent", adapter="policy", max_new_tokens=3)
    env = WordGame()
    episodes = rollout(env, env.tasks()[:2], policy, Asker(), group_size=2)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    one = build_method("single", policy, [Asker()], UpdateConfig(lr=0.0, epochs=1))
    want = grpo_update(model, "policy", one.policy_opt, episodes, "agent", adv, one.policy_cfg,
                       tokenizer.pad_token_id)
    two = build_method("single", policy, [Asker()], UpdateConfig(lr=0.0, epochs=2))
    param = next(p for n, p in model.named_parameters() if "lora_B" in n and "policy" in n)
    calls = []

    def first_infinite(grad):
        calls.append(1)
        return grad * float("inf") if len(calls) == 1 else grad
    hook = param.register_hook(first_infinite)
    out = grpo_update(model, "policy", two.policy_opt, episodes, "agent", adv, two.policy_cfg,
                      tokenizer.pad_token_id)
    hook.remove()
    assert out["skipped_steps"] == 1 and len(calls) == 2
    assert out["entropy"] > 0 and out["entropy"] == pytest.approx(want["entropy"], rel=1e-5)
    assert out["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
    assert out["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


# --------------------------------------------------------------------------- a server that misbehaves
class Canned:
    """A local HTTP server (127.0.0.1) whose answer to every POST is `self.answer(handler)`:
    raw bytes written to the socket, slowly if need be. Every loop in it is bounded."""

    def __init__(self):
        import http.server

        outer = self
        self.answer, self.requests = None, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.requests += 1
                try:
                    outer.answer(self)
                except OSError:          # the client hung up (as a deadline makes it do)
                    pass

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def json(self, obj=None, raw=None, headers=(), status=200):
        body = raw if raw is not None else json.dumps(obj).encode()

        def answer(h):
            h.send_response(status)
            for k, v in [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *headers]:
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(body)
        self.answer = answer

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def canned():
    c = Canned()
    yield c
    c.close()


def speaker(url, **kw):
    return ServedSpeaker.from_spec(f"openai:sim@{url}", **{"retries": 0, "timeout": 10, **kw})


def reply(content, **extra):
    return {"choices": [{"message": {"role": "assistant", "content": content}}], **extra}


# --------------------------------------------------------------------------- 12. the served client's fields
@pytest.mark.parametrize("body, why", [
    (reply(5), "choices[0].message.content is a number, not a string"),
    (reply(True), "choices[0].message.content is a boolean, not a string"),
    (reply([{"type": "text", "text": "hi"}]), "choices[0].message.content is a list, not a string"),
    (reply({"text": "hi"}), "choices[0].message.content is an object, not a string"),
    (reply("hi", usage="lots"), "usage is str, not an object"),
    (reply("hi", usage={"prompt_tokens": "7"}), "usage.prompt_tokens is '7', not a count"),
    (reply("hi", usage={"completion_tokens": -1}), "usage.completion_tokens is -1, not a count"),
    (reply("hi", usage={"completion_tokens": 2.5}), "usage.completion_tokens is 2.5, not a count"),
    ({"choices": [{"message": None}]}, "choices[0].message is not an object"),
    ({"choices": "all of them"}, "no choices"),
    ([1, 2, 3], "no choices"),
    (b"[" * 200_000 + b"]" * 200_000, "not JSON"),          # deeper than Python recurses
    (b"\xff\xfe not json", "not JSON"),
    (reply("a\ud800b"), "choices[0].message.content is not valid Unicode (a lone UTF-16 surrogate"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_malformed_reply_is_one_clean_stop_naming_the_endpoint(canned, body, why):
    """Before: TypeError for a number, boolean or malformed usage, RecursionError for a deep
    body, and list/dict content became a turn that was trained against."""
    canned.json(raw=body) if isinstance(body, bytes) else canned.json(body)
    with pytest.raises(ServedError, match=re.escape(f"endpoint {canned.url}/chat/completions answered without "
                                                    f"a chat completion ({why}")):
        speaker(canned.url).complete([[{"role": "user", "content": "hi"}]])
    canned.json(reply(None, usage=None))          # null content (a refusal, a tool call) is an empty turn
    assert speaker(canned.url).complete([[{"role": "user", "content": "hi"}]]) == [""]


# --------------------------------------------------------------------------- 13. deadline, size, exit, settings
def trickle(headers_first: bool):
    """An answer that never ends: one byte every 0.1 s (for at most 30 s), either of the
    headers or of a body that claims 1 MB."""
    def answer(h):
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
        if headers_first:
            h.wfile.write(head)
            h.wfile.flush()
        for _ in range(300):
            h.wfile.write(b" " if headers_first else head[:1])
            h.wfile.flush()
            time.sleep(0.1)
    return answer


@pytest.mark.parametrize("headers_first", [True, False], ids=["body", "headers"])
def test_the_timeout_bounds_the_whole_request_against_a_trickling_server(canned, headers_first):
    """Before: every read had the timeout, so a server sending a byte at a time held a
    1 s-timeout request as long as it liked (here: the trickle's 30 s)."""
    canned.answer = trickle(headers_first)
    t0 = time.perf_counter()
    with pytest.raises(ServedError, match="failed 2 times; the last failure: no answer within 1 s"):
        speaker(canned.url, timeout=1, retries=1, backoff=0).complete([[{"role": "user", "content": "hi"}]])
    assert time.perf_counter() - t0 < 10          # two 1 s attempts (and a loaded machine's slack)


def test_a_gzip_bomb_is_cut_at_the_size_cap_while_it_is_decoded(canned):
    """4 MB of JSON in 4 KB of gzip; the cap is set to 1 MB. Before: a 4 M-character turn."""
    bomb = gzip.compress(json.dumps(reply("a" * 4_000_000)).encode())
    assert len(bomb) < 10_000
    canned.json(raw=bomb, headers=[("Content-Encoding", "gzip")])
    s = speaker(canned.url)
    s.max_bytes = 2**20
    with pytest.raises(ServedError, match="answered more than 1048576 bytes"):
        s.complete([[{"role": "user", "content": "hi"}]])
    canned.json(raw=gzip.compress(json.dumps(reply("fine")).encode()), headers=[("Content-Encoding", "gzip")])
    assert s.complete([[{"role": "user", "content": "hi"}]]) == ["fine"]      # a normal gzip reply
    canned.json(raw=b"x" * (2**20 + 1))
    with pytest.raises(ServedError, match="answered more than"):
        s.complete([[{"role": "user", "content": "hi"}]])


STOP_SCRIPT = """
import sys, time
from minscope.served import ServedError, ServedSpeaker
s = ServedSpeaker.from_spec("openai:sim@" + sys.argv[1], timeout=60, retries=3)
try:
    s.complete([[{"role": "user", "content": str(i)}] for i in range(4)])
except ServedError as e:
    print("stopped", time.time(), e, flush=True)
"""


def test_the_process_exits_at_once_after_a_stop(canned):
    """One of four concurrent requests is refused (400), the other three hang. Before: the
    process stayed until the hanging requests' threads gave up (minutes)."""
    def answer(h):
        if h.server.first.acquire(blocking=False):
            h.send_response(400)
            h.send_header("Content-Length", "2")
            h.end_headers()
            h.wfile.write(b"{}")
            return
        time.sleep(30)
    canned.httpd.first = threading.Lock()
    canned.answer = answer
    proc = subprocess.Popen([sys.executable, "-c", STOP_SCRIPT, canned.url], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("stopped") and "refused the request: HTTP 400" in line, line
        proc.wait(timeout=20)
        assert time.time() - float(line.split()[1]) < 10
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("var, value, message", [
    ("MINSCOPE_SERVED_CONCURRENCY", "0", "expected a whole number, 1 or more"),
    ("MINSCOPE_SERVED_CONCURRENCY", "2.5", "expected a whole number, 1 or more"),
    ("MINSCOPE_SERVED_TIMEOUT", "nan", "expected a number of seconds above 0"),
    ("MINSCOPE_SERVED_TIMEOUT", "inf", "expected a number of seconds above 0"),
    ("MINSCOPE_SERVED_TIMEOUT", "0", "expected a number of seconds above 0"),
    ("MINSCOPE_SERVED_RETRIES", "-1", "expected a whole number, 0 or more"),
    ("MINSCOPE_SERVED_BACKOFF", "-0.5", "expected a number of seconds, 0 or more"),
])
def test_a_bad_served_setting_is_one_message(monkeypatch, var, value, message):
    """Before: CONCURRENCY=0 or RETRIES=-1 hung or raised a traceback; TIMEOUT=nan was taken."""
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit, match=f"^{var}='{re.escape(value)}': {message}$"):
        ServedSpeaker.from_spec("openai:sim@http://127.0.0.1:9/v1")


# --------------------------------------------------------------------------- 11. the server
KEY = "sk-local-test"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny model saved as Hugging Face saves one (config.json with model_type): a 1,024-token
    context, a ChatML template."""
    from minscope.models import build_tokenizer

    tok = build_tokenizer(WordGame().corpus() + ["hello there", "how are you"], vocab_size=300)
    model = build_tiny_model(tok, "qwen3", hidden_size=32, seed=0)
    folder = tmp_path_factory.mktemp("hf") / "tiny-checkpoint"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def guarded(hf_folder):
    """`python -m minscope.serve FOLDER --api-key KEY` with small limits, on 127.0.0.1."""
    from minscope.serve import make_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv, banner = make_server([str(hf_folder), "--name", "sim", "--port", str(port), "--api-key", KEY,
                               "--max-body-bytes", "65536", "--max-messages", "8"])
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.01)
    yield banner, f"http://127.0.0.1:{port}/v1", srv.generator
    srv.should_exit = True


def test_a_saved_hugging_face_folder_is_served_as_a_base_model(guarded, hf_folder, tmp_path):
    """Before: `KeyError: 'policy'` (every folder with a config.json was taken for a run)."""
    from minscope.serve import is_run_folder

    assert guarded[0].startswith(f"serving base model {hf_folder} as model 'sim' at http://127.0.0.1:")
    assert not is_run_folder(hf_folder)
    (tmp_path / "config.json").write_text(json.dumps({"format": FORMAT_VERSION,
                                                      "env": "p4g", "policy": "Qwen/Qwen3-1.7B", "method": "vs"}))
    assert is_run_folder(tmp_path)


WORDS = " ".join(WordGame().corpus())
GOOD = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


@pytest.mark.parametrize("change, status, says", [
    ({"messages": [{"role": "user", "content": "x" * 70_000}]}, 413, "over 65536 bytes"),
    ({"messages": [{"role": "user", "content": "hi"}] * 9}, 400, "1 to 8 messages"),
    ({"n": 17}, 400, "n must be between 1 and 16"),
    ({"messages": [{"role": "user", "content": (WORDS * 40)[:40_000]}]}, 400, "context is 1024 tokens"),
    ({"max_tokens": 0}, 400, "max_tokens must be at least 1, not 0"),
    ({"max_completion_tokens": -5}, 400, "max_tokens must be at least 1, not -5"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, 400, "enable_thinking must be true or false"),
    ({"temperature": "0.5"}, 400, "invalid 'temperature'"),
    ({"temperature": 11}, 400, "temperature must be between 0 and 10"),
    ({"stream": "false"}, 400, "invalid 'stream'"),
    ({"n": True}, 400, "invalid 'n'"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "not valid Unicode"),
    ({"messages": [{"role": 7, "content": "hi"}]}, 400, "invalid 'messages.0.role'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "text must be a string"),
    ({"model": "gpt-4o"}, 404, "does not exist"),
])
def test_a_bad_request_gets_its_own_4xx(guarded, change, status, says):
    """Before: 413 and the limits did not exist (a 40 KB prompt past the context took 2.1 GB
    and a minute), max_tokens 0 became 512, "no" turned thinking on, "0.5" was a number."""
    _, url, _ = guarded
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = json.dumps({**GOOD, **change})          # "\ud800" travels as the JSON escape it is
    r = httpx.post(f"{url}/chat/completions", content=body, headers=auth, timeout=60)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text[:300]
    assert httpx.post(f"{url}/chat/completions", json=GOOD, headers=auth, timeout=60).status_code == 200


def test_a_deeply_nested_body_and_a_missing_key_are_4xx(guarded):
    _, url, _ = guarded
    auth = {"Authorization": f"Bearer {KEY}"}
    deep = '{"model": "sim", "messages": [], "x": ' + "[" * 30_000 + "]" * 30_000 + "}"
    r = httpx.post(f"{url}/chat/completions", content=deep, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and "error parsing the body" in r.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert httpx.post(f"{url}/chat/completions", json=GOOD, headers=headers).status_code == 401
        assert httpx.get(f"{url}/models", headers=headers).status_code == 401
    # minscope's own client sends the key
    assert len(ServedSpeaker.from_spec(f"openai:sim@{url}", key=KEY, max_new_tokens=3).complete(
        [[{"role": "user", "content": "hello"}]])[0]) >= 0


def test_a_server_beyond_loopback_needs_an_api_key(monkeypatch):
    from minscope.serve import make_server

    monkeypatch.delenv("MINSCOPE_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="--host 0.0.0.0 listens beyond this machine: give --api-key"):
        make_server(["no-model-is-loaded", "--host", "0.0.0.0"])


def gated(generator):
    """Hold the worker in its first batch until the gate opens; record batch sizes."""
    sizes, gate, real = [], threading.Event(), generator.answer

    def answer(jobs):
        sizes.append(len(jobs))
        gate.wait(20)
        return real(jobs)
    generator.answer = answer
    return sizes, gate


def test_one_bad_request_in_a_batch_fails_alone(hf_folder):
    """A batch of a good request, a lone surrogate, temperature 5e-324, a prompt past the
    context and one that breaks generation. Before: every request of the batch failed."""
    from minscope.serve import Generator, Job, RequestError
    from minscope.models import load_model

    model, tok = load_model(str(hf_folder))
    gen = Generator(model, tok, max_batch=8)
    sizes, gate = gated(gen)
    hello = [{"role": "user", "content": "hello there"}]
    first = gen.submit(Job(hello, 0.0, 3))
    while not sizes:
        time.sleep(0.005)
    real = gen._sample
    gen._sample = lambda rows: (real(rows) if all(len(r[0]) != 999 for r in rows)
                                else (_ for _ in ()).throw(RuntimeError("generation broke")))
    breaking = Job([{"role": "user", "content": "apple"}], 0.5, 3)
    gen.checked_prompt = (lambda real_check: lambda job: [1] * 999 if job is breaking else real_check(job))(
        gen.checked_prompt)
    jobs = [Job(hello, 0.0, 3), Job([{"role": "user", "content": "\ud800"}], 1.0, 3), Job(hello, 5e-324, 3),
            Job([{"role": "user", "content": WORDS * 20}], 1.0, 3), breaking]
    futures = [gen.submit(j) for j in jobs]
    gate.set()
    want = first.result(30)["choices"][0]["message"]["content"]
    assert futures[0].result(30)["choices"][0]["message"]["content"] == want
    assert futures[2].result(30)["choices"][0]["message"]["content"] == want        # 5e-324 is greedy
    with pytest.raises(RequestError, match="cannot be formatted"):   # the tokenizer's refusal (HTTP: 400 first)
        futures[1].result(30)
    with pytest.raises(RequestError, match="context is 1024 tokens"):
        futures[3].result(30)
    with pytest.raises(RuntimeError, match="generation broke"):
        futures[4].result(30)
    assert sizes == [1, 5]


def test_the_batching_thread_outlives_a_cancelled_request(hf_folder):
    """A request whose client went away is cancelled while it waits. Before: the worker
    thread died on it (InvalidStateError), and the server never answered again."""
    from minscope.serve import Generator, Job
    from minscope.models import load_model

    model, tok = load_model(str(hf_folder))
    gen = Generator(model, tok, max_batch=8)
    sizes, gate = gated(gen)
    hello = [{"role": "user", "content": "hello there"}]
    first = gen.submit(Job(hello, 0.0, 3))
    while not sizes:
        time.sleep(0.005)
    gone = gen.submit(Job(hello, 0.0, 3))
    assert gone.cancel()
    kept = gen.submit(Job(hello, 0.0, 3))
    gate.set()
    assert first.result(30) and kept.result(30)
    assert gen.submit(Job(hello, 0.0, 3)).result(30)["choices"]


@pytest.mark.filterwarnings("ignore:'minscope.serve' found in sys.modules")   # runpy's, for a loaded module
def test_python_m_minscope_serve_runs_the_imported_module(monkeypatch):
    """`python -m minscope.serve` executes serve.py as `__main__`, a second copy of the module,
    whose RequestError is not the one serve_app catches (a prompt past the context came back
    as a 500 from the command). The command runs the imported module's main instead.
    (bench/studies/hostile_serving.py runs the command itself.)"""
    import runpy

    import minscope.serve as serve

    called = []
    monkeypatch.setattr(serve, "main", lambda: called.append(True))
    runpy.run_module("minscope.serve", run_name="__main__")
    assert called == [True]
