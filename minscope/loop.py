"""The training loop: the one `for step in ...` of minscope, shared by the toy's arms
(`experiment.run_arm`), the real-model runs (`runner.run_real`) and the SmolLM2 learning
check (`learning.train`).

One pass of the loop, in order:

    step % eval_every == 0 or last step:   rec = evaluate(step)         held-out panel
                                          log(rec)                      metrics + monitor
                                          rec[score] > best[score]?     the paper's rule:
                                              best = keep_best(step, rec)   keep that checkpoint
    last step: stop
    metrics = train(step)                  rollout -> rewards -> advantages -> update (methods.train_step)
    log(metrics)
    after_step(step)                       extras (the toy's pool measurements)
    save(step, best)                       everything needed to resume after this step

What differs between a toy arm and a real run (which tasks, how an evaluation is scored,
which files hold the state) lives in the callbacks; what a step *is* lives here. The state
saved after every step makes an interrupted run (Ctrl-C) lose at most the step in progress:
`--resume` continues at `start`, the first step not saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tqdm.auto import tqdm

from .monitor import CollapseMonitor, log_with_alarms


@dataclass
class Log:
    """Where the loop's records go: `write(rec)` (one line of metrics.jsonl), each followed by
    the collapse monitor's alarms (`monitor.log_with_alarms`, tagged with `tags`); `announce`
    prints the run's first alarm (None: silent)."""
    write: Callable[[dict], None]
    monitor: CollapseMonitor
    announce: Callable[[str], None] | None = None
    tags: dict | None = None

    def __call__(self, rec: dict) -> None:
        log_with_alarms(self.monitor, rec, self.write, self.announce, **(self.tags or {}))


def is_better(rec: dict, best: dict, score: str) -> bool:
    """The paper's checkpoint rule: keep the evaluated policy with the best held-out panel
    mean (`score`: the toy's "panel", a real run's "panel_mean"); the first evaluation is
    the first best."""
    return score not in best or rec[score] > best[score]


def run_loop(steps: int, eval_every: int, train: Callable[[int], dict], evaluate: Callable[[int], dict | None],
             log: Callable[[dict], None], save: Callable[[int, dict], None] | None = None,
             keep_best: Callable[[int, dict], dict] | None = None, score: str = "panel",
             start: int = 0, best: dict | None = None, after_step: Callable[[int], None] | None = None,
             desc: str = "train", progress: bool = True, stop_after: int | None = None) -> dict:
    """Run steps `start`..`steps` - 1, evaluating on schedule; returns the best record kept.

    train(step) -> the step's metrics record (`methods.train_step` plus the caller's fields).
    evaluate(step) -> the evaluation record, or None where this process does not evaluate
    (torchrun ranks > 0). log(rec) writes a record (a `Log`). keep_best(step, rec) saves the
    checkpoint that beat the best so far and returns what to remember of it. save(step, best)
    writes the resumable state after a step. stop_after: stop with KeyboardInterrupt once that
    many steps are done (tests simulate an interruption with it).
    """
    best = dict(best or {})
    bar = tqdm(range(start, steps + 1), desc=desc, initial=start, total=steps + 1, leave=False,
               disable=not progress)
    try:
        for step in bar:
            if step % eval_every == 0 or step == steps:
                rec = evaluate(step)
                if rec is not None:
                    log(rec)
                    if keep_best is not None and is_better(rec, best, score):
                        best = keep_best(step, rec)
                    bar.set_postfix({score: f"{rec[score]:.3f}"})
            if step == steps:
                break
            metrics = train(step)
            log(metrics)
            bar.set_postfix(reward=f"{metrics['train_reward']:.3f}")
            if after_step is not None:
                after_step(step)
            if save is not None:
                save(step, best)
            if stop_after is not None and step + 1 >= stop_after:
                raise KeyboardInterrupt   # (tests: an interruption after `stop_after` steps)
    finally:             # Ctrl-C included: train.py says how to --resume
        bar.close()
    return best
