"""Served simulators: `python -m minscope.serve` (FastAPI + uvicorn, a tiny real model) on a
free local port, and `served.ServedSpeaker` talking to it over HTTP as the frozen simulator,
through Verbalized Sampling, as an evaluation panel member, and against a server that fails."""
import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from test_chat_templates import make_tokenizer

import train as train_cli
from minscope.adapters import adapter_state, add_adapters, save_adapter
from minscope.chat import strip_reasoning
from minscope.envs.base import Episode, Turn
from minscope.envs.p4g import P4GEnv
from minscope.files import load_state, save_atomic
from minscope.models import build_tiny_model, load_model
from minscope.real_models import _attach_adapter, adapter_folder
from minscope.rollout import LMSpeaker
from minscope.runfolder import FORMAT_VERSION
from minscope.serve import Generator, Job, make_server
from minscope.served import (
    ServedError,
    ServedPersonaGuided,
    ServedSpeaker,
    parse_spec,
    take_usage,
)
from minscope.simulators import Ensemble, Verbalized

P4G_CSV = Path(__file__).parent / "fixtures" / "p4g" / "csv"
TINY = ["--groups", "1", "--group-size", "2", "--max-new-tokens", "3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A tiny Qwen3 (real template) and a run folder holding a trained-looking simulator
    adapter (random LoRA weights) and a population pool in state.pt."""
    env = P4GEnv(P4G_CSV)
    corpus = [m["content"] for t in env.tasks("all") for m in env.agent_messages(t) + env.partner_messages(t)]
    root = tmp_path_factory.mktemp("served")
    tok = make_tokenizer("qwen3", corpus, vocab_size=800)
    model = build_tiny_model(tok, "qwen3", hidden_size=32, seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    run = root / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"format": FORMAT_VERSION,
                                                 "env": "p4g", "policy": str(root / "model"), "simulator": None,
                                                 "method": "population", "load_in_4bit": False}))
    torch.manual_seed(3)
    peft = add_adapters(model, ["simulator"], init_lora_weights=False)
    save_adapter(peft, "simulator", run / "simulator-step3")
    snapshot = {k: v * 0 for k, v in adapter_state(peft, "simulator").items()}   # pool0 = the plain base
    save_atomic({"step": 3, "partner": {"pool": [(0, snapshot)]}}, run / "state.pt")
    return root / "model", run


@pytest.fixture(scope="module")
def server(run_folder):
    """`python -m minscope.serve RUN --adapter simulator --port P` (its `make_server`, run
    in a thread of this process); yields its base URL."""
    _, run = run_folder
    port = free_port()
    srv, banner = make_server([str(run), "--adapter", "simulator", "--name", "sim", "--port", str(port)])
    assert banner.startswith(f"serving {run} simulator-step3 as model 'sim' at http://127.0.0.1:{port}/v1")
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}/v1"
    srv.should_exit = True


def episodes(env, n):
    return [Episode(task=t, group=i) for i, t in enumerate(env.tasks("all")[:n])]


def test_the_server_speaks_the_openai_format(server):
    models = httpx.get(f"{server}/models").json()
    assert [m["id"] for m in models["data"]] == ["sim"] and models["object"] == "list"
    body = {"model": "sim", "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hello, how are you?"}],
            "temperature": 0.7, "max_tokens": 5, "n": 2}
    out = httpx.post(f"{server}/chat/completions", json=body, timeout=30).json()
    assert out["object"] == "chat.completion" and out["model"] == "sim" and len(out["choices"]) == 2
    for i, choice in enumerate(out["choices"]):
        assert choice["index"] == i and choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length")
    usage = out["usage"]
    assert usage["prompt_tokens"] > 5 and 2 <= usage["completion_tokens"] <= 10
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    wrong = httpx.post(f"{server}/chat/completions", json={**body, "model": "gpt-4o"})
    assert wrong.status_code == 404 and "'sim'" in wrong.json()["error"]["message"]
    assert httpx.post(f"{server}/chat/completions", json={**body, "stream": True}).status_code == 400


def test_a_served_greedy_turn_is_the_local_speakers_turn(server, run_folder):
    """The served simulator adapter at temperature 0 says, word for word, what the same
    adapter says through a local LMSpeaker: the same template, prompt and sampler."""
    model_dir, run = run_folder
    env = P4GEnv(P4G_CSV)
    model, tok = load_model(str(model_dir))
    model = _attach_adapter(model, "simulator", adapter_folder(str(run / "simulator-step3")))
    local = LMSpeaker(model, tok, "partner", adapter="simulator", temperature=0.0, max_new_tokens=8)
    eps = episodes(env, 3)
    for ep in eps:   # the persuader has spoken; the simulator answers
        ep.turns.append(Turn("agent", "Hi! Would you donate to Save the Children?"))
    _, ids, _ = local.generate([Episode(task=ep.task, group=ep.group, turns=list(ep.turns)) for ep in eps], env)
    want = [strip_reasoning(tok.decode([i for i in g if i not in local.eos], skip_special_tokens=True)) for g in ids]
    remote = ServedSpeaker.from_spec(f"openai:sim@{server}", temperature=0.0, max_new_tokens=8, name="served")
    turns = remote.respond(eps, env)
    assert [t.text for t in turns] == want
    assert all(t.role == "partner" and t.token_ids is None for t in turns)
    usage = take_usage([remote])
    assert usage["served_requests"] == 3 and usage["served_retries"] == 0
    assert usage["served_completion_tokens"] == sum(len(g) for g in ids)
    assert 0 < usage["served_latency_s"] <= usage["served_latency_max_s"]
    assert take_usage([remote])["served_requests"] == 0          # taken and reset


def test_a_run_trains_against_a_served_vs_simulator_and_evaluates_a_served_panel_member(server, run_folder,
                                                                                       tmp_path):
    model_dir, _ = run_folder
    train_cli.main(["--env", "p4g", "--data", str(P4G_CSV), "--policy", str(model_dir), "--method", "vs",
                    "--simulator", f"openai:sim@{server}", "--panel", f"unseen:openai:sim@{server}",
                    "--runs-dir", str(tmp_path), "--name", "run", "--steps", "1", "--groups", "1", "--group-size", "2",
                    "--max-new-tokens", "3"])
    recs = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in recs if r["kind"] == "train")
    # VS through the endpoint: every partner turn of 2 episodes asked for candidates (a
    # random tiny model never writes JSON, so each turn was retried twice, then fell back)
    assert step["vs_requests"] > 0 and step["vs_fallbacks"] == step["vs_requests"]
    assert step["served_requests"] == step["vs_requests"] + step["vs_retries"]
    assert step["served_prompt_tokens"] > 0 and step["served_completion_tokens"] > 0
    assert step["served_latency_s"] > 0 and step["served_retries"] == 0
    assert step["served_by"] == {"vs(train-simulator)": 1}
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1]
    assert all("sim" in r and "train-simulator" in r and "unseen" in r for r in evals)


# --------------------------------------------------------------------------- failures
class Flaky:
    """A chat-completions server that answers 500, hangs, answers 429 once, or forwards to
    a real server (mode "ok"), counting requests."""

    def __init__(self, upstream=None):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        self.mode, self.calls, self.upstream = "ok", 0, upstream
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            self.calls += 1
            body = self.last = await request.json()
            self.headers = dict(request.headers)
            if self.mode == "500":
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            if self.mode == "hang":
                await asyncio.sleep(30)
            if self.mode == "429-once":
                self.mode = "canned"
                return JSONResponse({"error": {"message": "slow down"}}, status_code=429,
                                    headers={"Retry-After": "0"})
            if self.mode == "canned":
                return {"choices": [{"message": {"role": "assistant", "content": "fine, thanks"}}],
                        "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
            async with httpx.AsyncClient(timeout=60) as client:
                r = await client.post(f"{self.upstream}/chat/completions", json=body)
            return JSONResponse(r.json(), status_code=r.status_code)

        import uvicorn

        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}/v1"

    def close(self):
        self.server.should_exit = True


@pytest.fixture
def flaky(server):
    f = Flaky(server)
    yield f
    f.close()


@pytest.mark.parametrize("mode", ["500", "hang"])
def test_a_failing_server_is_retried_then_named_in_one_clear_error(flaky, mode):
    flaky.mode = mode
    env = P4GEnv(P4G_CSV)
    speaker = ServedSpeaker.from_spec(f"openai:sim@{flaky.url}", timeout=0.3, retries=2, backoff=0.01)
    with pytest.raises(ServedError, match=f"simulator endpoint {flaky.url}/chat/completions .*failed 3 times"
                       + (".*HTTP 500" if mode == "500" else ".*no answer within 0.3 s")):
        speaker.respond(episodes(env, 1), env)
    assert flaky.calls == 3
    assert take_usage([speaker])["served_retries"] == 2


def test_a_429_is_retried_and_a_wrong_request_is_not(flaky):
    env = P4GEnv(P4G_CSV)
    flaky.mode = "429-once"
    speaker = ServedSpeaker.from_spec(f"openai:sim@{flaky.url}", retries=2, backoff=5.0)   # Retry-After: 0 wins
    t0 = time.perf_counter()
    assert [t.text for t in speaker.respond(episodes(env, 1), env)] == ["fine, thanks"]
    assert time.perf_counter() - t0 < 4 and flaky.calls == 2
    usage = take_usage([speaker])
    assert (usage["served_retries"], usage["served_prompt_tokens"], usage["served_completion_tokens"]) == (1, 7, 3)
    flaky.mode = "ok"
    wrong = ServedSpeaker.from_spec(f"openai:nosuchmodel@{flaky.url}", retries=3, backoff=0.01)
    with pytest.raises(ServedError, match="refused the request: HTTP 404"):
        wrong.respond(episodes(env, 1), env)
    assert flaky.calls == 3                       # not retried


def test_a_run_whose_simulator_endpoint_fails_stops_with_its_state_intact(flaky, run_folder, tmp_path,
                                                                         monkeypatch, capsys):
    """Step 0 is trained against the (forwarding) endpoint; then it fails with 500s: the
    resumed run stops with one line naming the endpoint, step 0's state and log untouched;
    once the endpoint is back, --resume trains step 1."""
    monkeypatch.setenv("MINSCOPE_SERVED_RETRIES", "1")
    monkeypatch.setenv("MINSCOPE_SERVED_BACKOFF", "0.01")
    model_dir, _ = run_folder
    run = tmp_path / "run"
    train_cli.main(["--env", "p4g", "--data", str(P4G_CSV), "--policy", str(model_dir), "--method", "single",
                    "--simulator", f"openai:sim@{flaky.url}", "--runs-dir", str(tmp_path), "--name", "run",
                    "--steps", "1", "--eval-every", "5", *TINY])
    state, log = (run / "state.pt").read_bytes(), (run / "metrics.jsonl").read_text()
    flaky.mode = "500"
    with pytest.raises(SystemExit) as stop:
        train_cli.main(["--env", "p4g", "--resume", str(run), "--steps", "2"])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert f"simulator endpoint {flaky.url}/chat/completions (model 'sim') failed 2 times" in err
    assert "Traceback" not in err
    assert (run / "state.pt").read_bytes() == state                  # still step 0's
    kept = [ln for ln in log.splitlines() if json.loads(ln)["step"] == 0]
    assert (run / "metrics.jsonl").read_text().splitlines() == kept   # step 0's records (step 1 is redone)
    flaky.mode = "ok"
    train_cli.main(["--env", "p4g", "--resume", str(run), "--steps", "2"])
    assert load_state(run / "state.pt")["step"] == 1
    steps = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "train"] == [0, 1]


# --------------------------------------------------------------------------- in-process parts
def test_concurrent_requests_are_generated_in_one_batch(run_folder):
    """While a batch is being generated, new requests wait; the worker then takes all of them at once."""
    model_dir, _ = run_folder
    model, tok = load_model(str(model_dir))
    gen = Generator(model, tok, max_batch=8)
    sizes, gate = [], threading.Event()
    real = gen.run

    def run(jobs):
        sizes.append(len(jobs))
        gate.wait(10)
        return real(jobs)

    gen.run = run
    msg = [{"role": "user", "content": "Hello"}]
    first = gen.submit(Job(msg, 0.0, 3))
    while not sizes:
        time.sleep(0.005)
    rest = [gen.submit(Job(msg, 0.0, 3)) for _ in range(4)]
    gate.set()
    texts = [f.result(30)["choices"][0]["message"]["content"] for f in [first, *rest]]
    assert sizes == [1, 4] and len(set(texts)) == 1       # greedy: the same reply in either batch


def test_the_vs_server_draws_one_reply_from_the_candidates(run_folder):
    model_dir, _ = run_folder
    model, tok = load_model(str(model_dir))
    gen = Generator(model, tok, vs_k=2, max_batch=4, seed=1)
    job = Job([{"role": "system", "content": "You are a donor."}, {"role": "user", "content": "Hi"}], 1.0, 4)
    assert "Answer with JSON only" in tok.decode(gen.prompt(job))
    canned = '{"responses": [{"text": "Sure, I can give.", "probability": 0.5}, ' \
             '{"text": "No thanks.", "probability": 0.5}]}'
    eos = next(iter(gen.eos))
    gen._sample = lambda rows: [(tok(canned, add_special_tokens=False)["input_ids"] + [eos], True) for _ in rows]
    out = gen.run([job, Job(job.messages, 1.0, 4, n=3)])
    replies = [c["message"]["content"] for r in out for c in r["choices"]]
    assert len(replies) == 4 and set(replies) <= {"Sure, I can give.", "No thanks."}
    assert all(c["finish_reason"] == "stop" for r in out for c in r["choices"])


def test_specs_and_wrong_settings_fail_before_any_model_loads(tmp_path, run_folder):
    assert parse_spec("openai:Qwen/Qwen3-8B@http://gpu:8000/v1/") == ("Qwen/Qwen3-8B", "http://gpu:8000/v1")
    with pytest.raises(ValueError, match="openai:MODEL@http://HOST:PORT/v1"):
        parse_spec("openai:Qwen3-8B")
    model_dir, run = run_folder
    common = ["--env", "p4g", "--data", str(P4G_CSV), "--policy", str(model_dir), "--runs-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="cannot read simulator 'openai:m@gpu:8000'"):
        train_cli.main([*common, "--panel", "openai:m@gpu:8000"])
    with pytest.raises(SystemExit, match="--method cotrain trains the simulator"):
        train_cli.main([*common, "--method", "cotrain", "--simulator", "openai:m@http://gpu:8000/v1"])
    from minscope.serve import load_target

    with pytest.raises(SystemExit, match="the pool holds 1 snapshot"):
        load_target(str(run), "pool1")
    with pytest.raises(SystemExit, match="choose policy, simulator or poolK"):
        load_target(str(run), "critic")
    # a pool snapshot is served: pool0 (zeroed weights) on the simulator adapter's layout
    model, _, slot, what = load_target(str(run), "pool0")
    assert slot == "served" and "pool snapshot 0 (step 0)" in what
    assert all(float(p.abs().sum()) == 0 for n, p in model.named_parameters() if ".served." in n)


def test_verbalized_persona_and_ensemble_with_served_simulators(flaky, monkeypatch):
    env = P4GEnv(P4G_CSV)
    flaky.mode = "canned"
    monkeypatch.setenv("MINSCOPE_SERVED_EXTRA", '{"chat_template_kwargs": {"enable_thinking": false}}')
    monkeypatch.setenv("MINSCOPE_API_KEY", "sk-test")
    base = ServedSpeaker.from_spec(f"openai:sim@{flaky.url}", max_new_tokens=10)
    vs = Verbalized(base, k=3, retries=1)
    assert "Answer with JSON only" in vs.speaker.messages_for(env, episodes(env, 1)[0])[0]["content"]
    assert vs.speaker.max_new_tokens == 40 and base.system_suffix == ""
    turns = vs.respond(episodes(env, 2), env)
    assert [t.text for t in turns] == ["fine, thanks"] * 2 and vs.stats.fallbacks == 2 and flaky.calls == 4
    assert flaky.last["chat_template_kwargs"] == {"enable_thinking": False} and flaky.last["max_tokens"] == 40
    assert "Answer with JSON only" in flaky.last["messages"][0]["content"]
    assert flaky.headers["authorization"] == "Bearer sk-test"
    persona = ServedPersonaGuided(base, ["a retired teacher", "a busy student"], seed=0)
    eps = episodes(env, 2)
    persona.assign(eps)
    assert all(ep.partner_name == "persona" and ep.info["persona"] in persona.personas for ep in eps)
    assert persona.messages_for(env, eps[0])[0]["content"].endswith("Play this person:\n" + eps[0].info["persona"])
    assert [t.text for t in persona.respond(eps, env)] == ["fine, thanks"] * 2
    members = [base.derive(name="a"), ServedSpeaker.from_spec(f"openai:other@{flaky.url}", name="b")]
    ensemble = Ensemble(members, seed=0)
    eps = [Episode(task=env.tasks("all")[0], group=g) for g in range(4)]
    ensemble.assign(eps)
    assert sorted(ep.partner_name for ep in eps) == ["a", "a", "b", "b"]
    assert [t.text for t in ensemble.respond(eps, env)] == ["fine, thanks"] * 4
    # copies share their original's counters: base's (VS 4, persona 2, member a 2) and member b's (2)
    assert take_usage(members)["served_requests"] == 10 and flaky.calls == 10
