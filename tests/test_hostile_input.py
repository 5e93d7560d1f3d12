"""Hostile input to the server, the served client, the run lock and the trainer (issue 32,
cases 11-15): each case below failed on the code before it, with a traceback, a crash, a
wrong number or two holders of one lock."""
import gzip
import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from minscope import files
from minscope.envs.wordgame import Asker, WordGame
from minscope.methods import build_method
from minscope.models import add_adapters, build_tiny_model
from minscope.rollout import LMSpeaker, rollout
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
