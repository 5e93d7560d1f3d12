"""A live simulator-collapse monitor: flags, during a run, the signature of a policy that
overfits its training simulator instead of learning the users.

It reads the records a run logs anyway (train steps and evaluations) and raises an alarm
when a signal crosses its threshold:

    divergence       training reward rising while held-out reward falls, over the last
                     `window` evaluations (held out = the panel's simulators that no arm
                     trains against: the toy's "unseen" group; sim-a..c, which the arms
                     train on, stay in the panel's mean for checkpoint selection)
    divergence_real  the same against the real users (the toy only: its unseen simulators
                     share sim-a's mode and prefer the collapsed policy, so the panel alone
                     can miss it; reported as a separate signal)
    entropy          the policy's entropy (mean of the last `window_steps` steps) below
                     `entropy_frac` of its start
    zero_var         the share of zero-variance groups (mean of the last `window_steps`)
                     above `zero_var`: the simulator answers every rollout of a task alike
    mode_prob        the training simulator's mode probability (collapse meter) above
                     `mode_prob`, once training has begun: a reading before the first step
                     describes the simulator, not what training does with it (an aligned
                     simulator reads ~0.9 there), so it is logged and not alarmed on

A fall counts only above the noise of the two evaluations it compares: it must exceed
`fall_z` standard errors of their difference, z * sqrt(SE_first^2 + SE_last^2), read from the
record's `<key>_se` or `<key>_ci95` (and at least `min_fall`). One toy real-user evaluation
(128 episodes) has SE ~0.022, so a fixed 0.02 fall was crossed by a flat policy about a
quarter of the time; at z = 2 a flat policy crosses it about 2% of the time per window
(tests/test_monitor.py measures both).

An alarm is logged once per signal, when it first fires (`{"kind": "alarm", "step", "signal",
"alarm_<signal>": value, ...}`); the caller prints one console line per run or arm. The
state is a function of the records alone, so a resumed run replays its log (`replay`).
The default thresholds of zero_var, entropy and mode_prob were derived on seeds 3-5 of the
default settings by the float32 code (never reported as the headline; docs/ARCHIVE.md, "The collapse monitor: thresholds"):
`python -m minscope.monitor RUN --derive` sets each one 0.05 past the furthest reading of the
arms that end above the untrained policy (`derive_thresholds`). There the Ensemble ended well
above the untrained policy with half its groups zero-variance and its simulators' mode
probability at 0.95, so zero_var alarms only above 0.7, entropy below 0.1 of its start, and
mode_prob never (1.0): on the shipped tiny models those three signals do not separate a
collapsing arm from a healthy one, and the divergence alarms carry the monitor.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields

import numpy as np

SIGNALS = ("divergence", "divergence_real", "entropy", "zero_var", "mode_prob")


@dataclass
class MonitorConfig:
    window: int = 3               # evaluations in the divergence window
    min_rise: float = 0.1         # training reward must rise at least this much over it ...
    min_fall: float = 0.02        # ... while held-out reward falls at least this much, and
    fall_z: float = 2.0           # ... more than this many SEs of the two evaluations' difference
    window_steps: int = 5         # training steps averaged for entropy and zero_var
    entropy_frac: float = 0.1     # alarm below this fraction of the starting entropy
    zero_var: float = 0.7         # alarm above this share of zero-variance groups
    mode_prob: float = 1.0        # alarm above this simulator mode probability (1.0: never)


def threshold_problem(key: str, value) -> str | None:
    """What is wrong with `value` for the threshold `key` (None: nothing). Whole numbers for
    the windows (a divergence window of two evaluations or more, a step window of one or
    more), finite numbers for the rest: NaN compares false and would silence an alarm."""
    import math

    kind = type(getattr(MonitorConfig, key))
    if kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{key} takes a whole number, not {value!r}"
        least = 2 if key == "window" else 1
        return f"{key} must be {least} or more, not {value}" if value < least else None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{key} takes a number, not {value!r}"
    return None if math.isfinite(value) else f"{key} must be a finite number, not {value}"


def config_thresholds(config: dict, where) -> MonitorConfig:
    """The thresholds of a run's config.json ("monitor"), or RunFileError naming the file."""
    from .files import RunFileError

    saved = config.get("monitor") or {}
    if not isinstance(saved, dict):
        raise RunFileError(f"{where} is damaged: \"monitor\" is not an object of thresholds")
    names = {f.name for f in fields(MonitorConfig)}
    for key, value in saved.items():
        why = f"unknown threshold {key!r}" if key not in names else threshold_problem(key, value)
        if why:
            raise RunFileError(f"{where} is damaged: \"monitor\": {why}")
    return MonitorConfig(**saved)


class CollapseMonitor:
    def __init__(self, cfg: MonitorConfig | None = None, panel_key: str = "unseen",
                 real_key: str | None = "real_users"):
        self.cfg = cfg or MonitorConfig()
        self.panel_key = panel_key        # the eval record's held-out mean (the toy: its unseen simulators)
        self.real_key = real_key          # a held-out score of real users, where the run has one
        self.fired: dict[str, int] = {}   # signal -> first step
        self.entropy0 = None
        self.recent = deque(maxlen=self.cfg.window_steps)      # (entropy, zero_var) per step
        self.since_eval: list[float] = []                      # train rewards since the last eval
        self.evals = deque(maxlen=self.cfg.window)             # (train reward, panel, real)

    def _alarm(self, signal: str, step: int, value: float, detail: str) -> list[dict]:
        if signal in self.fired:
            return []
        self.fired[signal] = step
        return [{"kind": "alarm", "step": step, "signal": signal, f"alarm_{signal}": float(value), "detail": detail}]

    def on_train(self, rec: dict) -> list[dict]:
        c, out = self.cfg, []
        if rec.get("train_reward") is not None:
            self.since_eval.append(rec["train_reward"])
        if rec.get("zero_var_frac") is None:
            return out
        # a skipped update (UpdateConfig.skip_zero_signal) measures no entropy: its step still
        # counts for zero_var, and the entropy is the mean of the window's measured steps
        self.recent.append((rec.get("policy_entropy"), rec["zero_var_frac"]))
        if len(self.recent) < c.window_steps:
            return out
        zv = float(np.mean([z for _, z in self.recent]))
        measured = [e for e, _ in self.recent if e is not None]
        ent = float(np.mean(measured)) if measured else None
        if self.entropy0 is None:
            self.entropy0 = ent                 # the first full window is the start
        if ent is not None and self.entropy0 is not None and ent < c.entropy_frac * self.entropy0:
            out += self._alarm("entropy", rec["step"], ent, f"policy entropy {ent:.2f} < {c.entropy_frac:g} x "
                                                           f"its start {self.entropy0:.2f}")
        if zv > c.zero_var:
            out += self._alarm("zero_var", rec["step"], zv, f"zero-variance groups {zv:.2f} > {c.zero_var:g}")
        return out

    def on_eval(self, rec: dict) -> list[dict]:
        c, out, step = self.cfg, [], rec["step"]
        mode = (rec.get("meter") or {}).get("mode_prob")
        trained = bool(self.since_eval or self.evals)      # a train record came before
        if trained and mode is not None and np.isfinite(mode) and mode > c.mode_prob:
            out += self._alarm("mode_prob", step, mode, f"simulator mode probability {mode:.2f} > {c.mode_prob:g}")
        if self.since_eval:                     # evaluations with training behind them
            self.evals.append((float(np.mean(self.since_eval)), _score(rec, self.panel_key),
                               _score(rec, self.real_key) if self.real_key else (None, None)))
            self.since_eval = []
        if len(self.evals) == c.window:
            first, last = self.evals[0], self.evals[-1]
            rise = last[0] - first[0]
            for signal, i in (("divergence", 1), ("divergence_real", 2)):
                (a, se_a), (b, se_b) = first[i], last[i]
                if a is None or b is None or rise < c.min_rise:
                    continue
                fall, need = a - b, self.fall_threshold(se_a, se_b)
                if fall >= need:
                    where = "held-out simulators" if i == 1 else "real users"
                    out += self._alarm(signal, step, fall, f"train reward +{rise:.2f} while the {where}' "
                                                           f"reward fell {fall:.2f} (> {need:.2f}, its noise) "
                                                           f"over {c.window} evaluations")
        return out

    def fall_threshold(self, se_first, se_last) -> float:
        """The fall that counts: `fall_z` SEs of the difference, at least `min_fall`; only
        `min_fall` when an evaluation carries no standard error."""
        c = self.cfg
        if se_first is None or se_last is None:
            return c.min_fall
        return max(c.min_fall, c.fall_z * float(np.hypot(se_first, se_last)))

    def on_record(self, rec: dict) -> list[dict]:
        kind = rec.get("kind")
        return self.on_train(rec) if kind == "train" else self.on_eval(rec) if kind == "eval" else []

    def replay(self, records) -> None:
        """Rebuild the state from a resumed run's log (its alarm records included)."""
        for rec in records:
            if rec.get("kind") == "alarm":
                self.fired.setdefault(rec["signal"], rec["step"])
            else:
                self.on_record(rec)


def _score(rec: dict, key: str) -> tuple:
    """(mean, standard error) of `key` in an eval record; the SE from `<key>_se`, else from
    the width of `<key>_ci95` (a 95% interval: 2 x 1.96 SEs), else None."""
    mean = rec.get(key)
    se = rec.get(f"{key}_se")
    ci = rec.get(f"{key}_ci95")
    if se is None and ci is not None and all(x is not None and np.isfinite(x) for x in ci):
        se = (ci[1] - ci[0]) / (2 * 1.959964)
    return mean, se


def log_with_alarms(monitor: CollapseMonitor, rec: dict, write, announce=None, **tags) -> None:
    """write(rec), then write every alarm it raises (tagged with `tags`); `announce(line)` is
    called for the first alarm of the run only: one console line, not a flood."""
    write(rec)
    for alarm in monitor.on_record(rec):
        write({**alarm, **tags})
        if announce is not None and len(monitor.fired) == 1:
            announce(f"collapse monitor: {alarm['detail']} (step {alarm['step']}; every alarm: "
                     "'kind': 'alarm' records in metrics.jsonl)")


def first_alarms(records) -> dict:
    """{signal: first step} of the alarm records of one run or arm."""
    out = {}
    for r in records:
        if r.get("kind") == "alarm":
            out.setdefault(r["signal"], r["step"])
    return out


def relog(records, cfg: MonitorConfig, **kw) -> list[dict]:
    """A finished log as a live monitor with thresholds `cfg` would have written it: its train
    and eval records, each followed by the alarms it raises (old alarm records dropped). The
    monitor only reads the records, so training does not depend on its thresholds."""
    mon, out = CollapseMonitor(cfg, **kw), []
    for rec in records:
        if rec.get("kind") == "alarm":
            continue
        out.append(rec)
        tags = {k: rec[k] for k in ("method", "seed") if k in rec}
        out += [{**a, **tags} for a in mon.on_record(rec)]
    return out


def extremes(records, cfg: MonitorConfig) -> dict:
    """How far one arm's log went on the three threshold signals: the highest share of
    zero-variance groups and the lowest entropy fraction of its start (means of `window_steps`
    steps, as the monitor reads them), and the highest mode probability after training began."""
    recent, start, out = deque(maxlen=cfg.window_steps), None, {"zero_var": [], "entropy_frac": [], "mode_prob": []}
    trained = False
    for r in records:
        if r.get("kind") == "train" and r.get("policy_entropy") is not None and r.get("zero_var_frac") is not None:
            trained = True
            recent.append((r["policy_entropy"], r["zero_var_frac"]))
            if len(recent) == cfg.window_steps:
                ent, zv = (float(np.mean(x)) for x in zip(*recent))
                start = ent if start is None else start
                out["zero_var"].append(zv)
                out["entropy_frac"].append(ent / start if start > 0 else 1.0)
        elif r.get("kind") == "eval" and trained and (r.get("meter") or {}).get("mode_prob") is not None:
            out["mode_prob"].append(r["meter"]["mode_prob"])
    pick = {"zero_var": max, "entropy_frac": min, "mode_prob": max}
    return {k: pick[k](v) if v else None for k, v in out.items()}


def derive_thresholds(logs: dict, healthy, cfg: MonitorConfig, step: float = 0.05) -> MonitorConfig:
    """Thresholds under which none of the `healthy` arms (names of `logs`: arm -> records)
    would have raised the three threshold alarms: each set one `step` (0.05) past the
    furthest any healthy arm went (zero_var and mode_prob above its highest reading,
    entropy_frac below its lowest). Choose them on a run whose seeds you then do not report;
    the divergence alarms need no such choice (their threshold is the evaluations' noise)."""
    import math

    seen = [extremes(logs[a], cfg) for a in healthy]

    def furthest(key, pick):
        vals = [e[key] for e in seen if e[key] is not None]
        return pick(vals) if vals else None
    zv, ent, mode = furthest("zero_var", max), furthest("entropy_frac", min), furthest("mode_prob", max)
    from dataclasses import replace

    out = cfg
    if zv is not None:      # strictly past the furthest healthy reading
        out = replace(out, zero_var=round(min(1.0, math.floor(zv / step + 1 + 1e-9) * step), 4))
    if mode is not None:
        out = replace(out, mode_prob=round(min(1.0, math.floor(mode / step + 1 + 1e-9) * step), 4))
    if ent is not None:
        out = replace(out, entropy_frac=round(max(0.0, math.ceil(ent / step - 1 - 1e-9) * step), 4))
    return out


def healthy_arms(logs: dict) -> list[str]:
    """The arms (of a toy run's logs, arm -> records) whose last real-user evaluation ends
    above the untrained policy's (the mean of its "base" arms): what the monitor must not flag."""
    def final(records):
        evals = [r for r in records if r.get("kind") == "eval" and r.get("real_users") is not None]
        return evals[-1]["real_users"] if evals else None
    base = [final(r) for a, r in logs.items() if a.partition("-s")[0] == "base" and final(r) is not None]
    if not base:
        raise ValueError("no 'base' arm with an evaluation: nothing to call healthy against")
    level = float(np.mean(base))
    return [a for a, r in logs.items() if a.partition("-s")[0] != "base" and (final(r) or -1) > level]


def main(argv=None):
    """python -m minscope.monitor RUN_DIR [--set KEY=VALUE ...] [--write]: the alarms of a run
    (each arm of a toy run; a real-model run's metrics.jsonl) under other thresholds (to choose
    them from a run's own curves); --write also replaces the alarm records in its logs and the
    thresholds in its config.json (a resumed real run goes on with them), once no process
    trains in the run (its lock)."""
    import argparse
    from dataclasses import fields
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m minscope.monitor", description=main.__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a threshold, e.g. entropy_frac=0.3 (keys: " + ", ".join(f.name for f in fields(MonitorConfig)) + ")")
    p.add_argument("--write", action="store_true", help="rewrite the run's alarm records and config.json")
    p.add_argument("--derive", action="store_true",
                   help="thresholds from this run: one 0.05 step past the furthest reading of every arm that "
                        "ends above the untrained policy (derive_thresholds); then --set, and the alarms under them")
    args = p.parse_args(argv)
    lock = None
    if args.write:
        # a trainer appends to the logs through a handle it keeps open: rewriting them under it
        # would send its later records to a deleted file, so --write waits for the run to stop
        # (the lock also keeps a trainer from starting while the files are rewritten)
        from .files import RunFileError, RunLock, read_json

        if not (args.run_dir / "config.json").is_file():
            read_json(args.run_dir / "config.json")          # the usual message, before any lock file
        try:
            lock = RunLock(args.run_dir).acquire()
        except RunFileError as e:
            raise RunFileError(f"--write: {e}; the alarms can be read without --write meanwhile") from None
    try:
        _main(p, args)
    finally:
        if lock is not None:
            lock.release()


def _main(p, args):
    import json
    from dataclasses import asdict, fields, replace

    from .files import read_json, write_text_atomic
    from .runfolder import read_log as read_jsonl

    config = read_json(args.run_dir / "config.json")
    cfg = config_thresholds(config, args.run_dir / "config.json")
    logs = sorted((args.run_dir / "arms").glob("*.jsonl"))
    real = not logs and "models" not in config         # a real-model run (train.py --env p4g|tau2|...)
    keys = dict(panel_key="unseen", real_key=None) if real else {}   # as runner.run_real watches it
    if real:
        logs = [args.run_dir / "metrics.jsonl"]
        if not logs[0].is_file():
            p.error(f"{args.run_dir} has no metrics.jsonl (nor arms/*.jsonl): is it a run folder train.py wrote?")
    elif not logs:
        p.error(f"{args.run_dir} has no arms/*.jsonl: is it a toy run?")
    if args.derive and real:
        p.error("--derive needs a toy run: it calls an arm healthy against the untrained policy's real-user "
                "reward, which a real-model run does not have; choose thresholds with --set")
    if args.derive:
        records = {log.stem: read_jsonl(log) for log in logs}
        try:
            healthy = healthy_arms(records)
        except ValueError as e:
            p.error(f"--derive: {e}")
        cfg = derive_thresholds(records, healthy, cfg)
        print(f"healthy arms (final real-user reward above the untrained policy's): {', '.join(healthy) or 'none'}")
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in {f.name for f in fields(MonitorConfig)}:
            p.error(f"--set {item}: unknown threshold {key!r}")
        kind = type(getattr(MonitorConfig, key))
        try:
            number = kind(value)
        except ValueError:
            p.error(f"--set {item}: {key} takes {'a whole number' if kind is int else 'a number'}, not {value!r}")
        if why := threshold_problem(key, number):
            p.error(f"--set {item}: {why}")
        cfg = replace(cfg, **{key: number})
    print(f"thresholds: {cfg}\n{'run' if real else 'arm':28s} first step of each signal")
    if real and not any(r.get("kind") == "eval" and r.get("unseen") is not None for r in read_jsonl(logs[0])):
        print("(no unseen panel member: the divergence alarm cannot fire; train with --panel unseen:MODEL)")
    for log in logs:
        records = relog(read_jsonl(log), cfg, **keys)
        alarms = [r for r in records if r.get("kind") == "alarm"]
        print(f"{args.run_dir.name if real else log.stem:28s} " + (", ".join(f"{a['signal']} {a['step']}" for a in alarms) or "-"))
        if args.write:
            write_text_atomic(log, "".join(json.dumps(r) + "\n" for r in records))
    if args.write:
        from .runfolder import merge_metrics

        config["monitor"] = asdict(cfg)
        write_text_atomic(args.run_dir / "config.json", json.dumps(config, indent=2))
        if not real:
            merge_metrics(args.run_dir)
        print(f"rewritten; the report: python eval.py {args.run_dir} --report-only")


if __name__ == "__main__":
    main()
