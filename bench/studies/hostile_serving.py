"""Benchmark: `python -m minscope.serve` and the served client against hostile peers, with
figures, for the cases too slow or too large for a test (the trickling server and the gzip bomb among them).

    python bench/studies/hostile_serving.py                      this checkout
    python bench/studies/hostile_serving.py --repo ../main       another checkout (before/after)

The minscope of --repo is imported here and runs the server (a subprocess, 127.0.0.1). The
model is a tiny random Qwen3 with a 1,024-token context (CPU). Measured:

  server   a --kb KB prompt (past the context): status, seconds, the server's peak RSS
           (VmHWM) before and after; six concurrent requests, two of them bad (temperature
           5e-324; content "\\ud800"): the six statuses; max_tokens 0 and
           enable_thinking "no": status and completion tokens
  client   a server trickling one byte per 0.1 s (for at most --trickle-s s) against a 1 s
           timeout: seconds until the request returns; a gzip bomb (--bomb-mb MB of JSON in
           about a thousandth of that): the turn's length or the error, this process's peak
           RSS; a stop (one request refused, three hanging for 60 s each try): seconds to
           the ServedError and from it to the process's exit (waited for at most --stop-s)

Every loop is bounded; nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=HERE, help="the checkout whose minscope is measured (default: this one)")
    p.add_argument("--kb", type=int, default=40, help="size of the long prompt in KB (default 40)")
    p.add_argument("--trickle-s", type=float, default=20.0, help="how long the trickling server trickles (default 20)")
    p.add_argument("--stop-s", type=float, default=120.0, help="how long to wait for the stopped process (default 120)")
    p.add_argument("--bomb-mb", type=int, default=200, help="decoded size of the gzip bomb in MB (default 200)")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def tiny_model(folder: Path) -> str:
    from minscope.envs.wordgame import WordGame
    from minscope.models import build_tiny_model, build_tokenizer

    tok = build_tokenizer(WordGame().corpus() + ["hello there", "how are you"], vocab_size=300)
    model = build_tiny_model(tok, "qwen3", hidden_size=32, seed=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return " ".join(WordGame().corpus())


LAUNCH = """
import sys, uvicorn
from minscope.models import load_model
from minscope.serve import Generator
try:
    from minscope.serve_app import build_app
except ImportError:
    from minscope.serve import build_app
model, tok = load_model(sys.argv[1])
uvicorn.run(build_app(Generator(model.eval(), tok), "sim"), host="127.0.0.1", port=int(sys.argv[2]),
            log_level="warning")
"""


def start_server(cmd, repo, env):
    """(process, base URL) of a server started with `python CMD --port P`, once it answers;
    (None, its last error line) if it exits first."""
    import httpx

    port = free_port()
    argv = [sys.executable, *cmd, *(["--port"] if cmd[0] == "-m" else []), str(port)]
    proc = subprocess.Popen(argv, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 300                  # a loaded machine loads a model slowly
    while True:
        try:
            httpx.get(f"{url}/models", timeout=1)
            return proc, url
        except httpx.TransportError:
            if proc.poll() is not None:
                lines = [ln for ln in proc.stderr.read().splitlines() if ln.strip()]
                return None, (lines[-1] if lines else f"exited {proc.returncode}")
            if time.time() > deadline:
                proc.kill()
                raise SystemExit("the server did not start") from None
            time.sleep(0.2)


def server_cases(repo: Path, kb: int):
    import httpx

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        words = tiny_model(folder)
        env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
        env.pop("MINSCOPE_API_KEY", None)
        proc, url = start_server(["-m", "minscope.serve", str(folder), "--name", "sim"], repo, env)
        if proc is None:     # a checkout that cannot serve a Hugging Face folder: serve it from Python
            print(f"server: python -m minscope.serve {folder.name}/ (a saved Hugging Face model): {url}")
            proc, url = start_server(["-c", LAUNCH, str(folder)], repo, env)
        else:
            print(f"server: python -m minscope.serve {folder.name}/ (a saved Hugging Face model): serving")
        try:
            post = lambda body, **kw: httpx.post(f"{url}/chat/completions", content=body,  # noqa: E731
                                                 headers={"Content-Type": "application/json"}, timeout=600)
            hello = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
            post(json.dumps(hello))
            before = vm_hwm_mb(proc.pid)
            long = {**hello, "messages": [{"role": "user", "content": (words * (kb * 8))[:kb * 1024]}]}
            t0 = time.perf_counter()
            r = post(json.dumps(long))
            print(f"server: a {kb} KB prompt: HTTP {r.status_code} in {time.perf_counter() - t0:.1f} s; "
                  f"server peak RSS {before:.0f} MB -> {vm_hwm_mb(proc.pid):.0f} MB")
            bodies = [json.dumps(hello)] * 4 + [json.dumps({**hello, "temperature": 5e-324}),
                                                json.dumps({**hello, "messages": [{"role": "user", "content": "\ud800"}]})]
            with ThreadPoolExecutor(6) as pool:
                codes = list(pool.map(lambda b: post(b).status_code, bodies))
            print(f"server: 4 good requests + temperature 5e-324 + content \"\\ud800\", sent at once: HTTP {codes}")
            for name, change in [("max_tokens 0", {"max_tokens": 0}),
                                 ("enable_thinking \"no\"", {"chat_template_kwargs": {"enable_thinking": "no"}})]:
                r = post(json.dumps({**hello, **change}))
                got = r.json().get("usage", {}).get("completion_tokens") if r.status_code == 200 else None
                print(f"server: {name}: HTTP {r.status_code}" + (f", {got} completion tokens" if got is not None else ""))
        finally:
            proc.kill()
            proc.wait()


class Peer:
    """A local server whose every answer is `answer(handler)` (bounded)."""

    def __init__(self, answer):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                try:
                    answer(self)
                except OSError:
                    pass

            def log_message(self, *a):
                pass
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


STOP = """
import sys, time
from minscope.served import ServedError, ServedSpeaker
s = ServedSpeaker.from_spec("openai:sim@" + sys.argv[1], timeout=60, retries=3)
try:
    s.complete([[{"role": "user", "content": str(i)}] for i in range(4)])
except ServedError:
    print(time.time(), flush=True)
"""


def client_cases(repo: Path, trickle_s: float, bomb_mb: int, stop_s: float):
    from minscope.served import ServedSpeaker

    def outcome(call):
        t0 = time.perf_counter()
        try:
            out = call()
            what = f"returned a {len(out[0]):,}-character turn"
        except BaseException as e:  # noqa: BLE001 - what the client does is the measurement
            what = f"{type(e).__name__}: {str(e)[:90]}"
        return time.perf_counter() - t0, what

    def trickle(h):
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
        for _ in range(int(trickle_s * 10)):
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.1)
    peer = Peer(trickle)
    spk = ServedSpeaker.from_spec(f"openai:sim@{peer.url}", timeout=1, retries=0)
    seconds, what = outcome(lambda: spk.complete([[{"role": "user", "content": "hi"}]]))
    print(f"client: 1 s timeout, server trickling for {trickle_s:g} s: {seconds:.1f} s, {what}")
    peer.close()

    pack = zlib.compressobj(9, zlib.DEFLATED, 31)          # gzip, built piece by piece
    parts = [pack.compress(b'{"choices": [{"message": {"role": "assistant", "content": "')]
    parts += [pack.compress(b"a" * 10**6) for _ in range(bomb_mb)]
    bomb = b"".join(parts + [pack.compress(b'"}}]}'), pack.flush()])

    def send_bomb(h):
        h.send_response(200)
        for k, v in [("Content-Type", "application/json"), ("Content-Encoding", "gzip"), ("Content-Length", str(len(bomb)))]:
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(bomb)
    peer = Peer(send_bomb)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    spk = ServedSpeaker.from_spec(f"openai:sim@{peer.url}", timeout=60, retries=0)
    seconds, what = outcome(lambda: spk.complete([[{"role": "user", "content": "hi"}]]))
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"client: a {len(bomb) // 1000} KB gzip body of {bomb_mb} MB: {seconds:.1f} s, {what}; "
          f"peak RSS {rss0:.0f} MB -> {rss1:.0f} MB")
    peer.close()

    first = threading.Lock()

    def refuse_one(h):
        if first.acquire(blocking=False):
            h.send_response(400)
            h.send_header("Content-Length", "2")
            h.end_headers()
            h.wfile.write(b"{}")
        else:
            time.sleep(60)
    peer = Peer(refuse_one)
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-c", STOP, peer.url], stdout=subprocess.PIPE, text=True, cwd=repo,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        proc.wait(timeout=stop_s)
        stopped = float(proc.stdout.read().strip() or "nan")
        print(f"client: a stop with 3 requests hanging: ServedError {stopped - started:.1f} s after the start, "
              f"the process exited {time.time() - stopped:.1f} s after it")
    except subprocess.TimeoutExpired:
        print(f"client: a stop with 3 requests hanging: the process was still running {stop_s:g} s after its start")
    proc.kill()
    proc.wait()
    peer.close()


def main(argv=None):
    args = parse_args(argv)
    repo = args.repo.resolve()
    sys.path.insert(0, str(repo))
    print(f"minscope of {repo}")
    server_cases(repo, args.kb)
    client_cases(repo, args.trickle_s, args.bomb_mb, args.stop_s)


if __name__ == "__main__":
    main()
