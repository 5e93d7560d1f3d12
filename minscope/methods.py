"""The methods the paper compares, and the one training step they all share.

    single               RL against one frozen simulator            (the collapse baseline)
    vs                   ... with Verbalized Sampling of that simulator   (fix 1)
    ensemble             K frozen simulators rotated across groups and rollouts
    persona              a frozen simulator + a persona drawn per group
    cotrain              the simulator is a trained adapter too           (fix 2)
    population           ... and groups draw from a FIFO pool of its snapshots
    selfplay             the policy plays both roles; one update on both roles' tokens
                         (the partner's with the opponent's reward 1 - r on asymmetric tasks)
    population-selfplay  the partner is drawn from the policy's recent snapshots (the policy
                         learns from its own, agent, turns: the partner's are the snapshots')
    oracle               train directly on a scripted "real user" partner (toy only)

`train_step` is the whole algorithm: roll out groups against the method's simulator(s),
score, update the policy with GRPO; for Co-Training update the simulator from the same
episodes (its own tokens, its own reward); for the population, snapshot on schedule.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from .compute import step_compute
from .envs.base import Episode
from .grpo import group_advantages, simulator_rewards
from .precision import round_parameters, widen, work_dtype
from .rollout import LMSpeaker, rollout
from .simulators import Ensemble, PersonaGuided, Population, Trainable, Verbalized
from .trainer import UpdateConfig, grpo_update, make_optimizer, skip_step

METHODS = ("single", "vs", "ensemble", "persona", "cotrain", "population", "selfplay",
           "population-selfplay", "oracle")


@dataclass
class Method:
    """What one training arm runs: the policy speaker, its partner, and optimizers."""
    name: str
    policy: LMSpeaker
    partner: object
    policy_opt: torch.optim.Optimizer
    policy_cfg: UpdateConfig
    sim_opt: torch.optim.Optimizer | None = None
    sim_cfg: UpdateConfig | None = None
    sim_baseline: str = "auto"        # how simulator advantages are normalised: auto | group | batch
                                      # (see resolve_sim_baseline)
    # Realism anchor: a function returning a batch (ids, attention, mask) of real-user
    # transcripts; the simulator also takes an SFT step on it, weighted by `anchor_weight`,
    # so that becoming informative for the policy does not cost it its realism.
    anchor: object = None
    anchor_weight: float = 0.5
    anchor_skipped: int = 0           # anchor steps not applied: non-finite loss or gradient
    anchor_tokens: tuple = (0, 0)     # the last anchor batch's (real, trained) tokens (minscope/compute.py)

    @property
    def trains_simulator(self) -> bool:
        return self.sim_opt is not None


def build_method(name: str, policy: LMSpeaker, frozen: list, policy_cfg: UpdateConfig,
                 sim_cfg: UpdateConfig | None = None, sim_model=None, sim_tokenizer=None,
                 sim_reward: str = "adversarial", personas=None, vs_k: int = 5,
                 vs_mode: str = "weighted", pool_size: int = 5, pool_every: int = 4,
                 oracle=None, seed: int = 0, sim_baseline: str = "auto",
                 sim_temperature: float | None = None, pool_draw: str = "uniform") -> Method:
    """Assemble a method from parts.

    frozen: simulators (Frozen speakers); `single`/`vs`/`persona` use frozen[0], `ensemble`
    uses all of them. `cotrain`/`population` train adapter "simulator" on `sim_model` (which
    must carry that adapter), sampled at `sim_temperature` (default: frozen[0]'s); `pool_draw`:
    how Population Co-Training's groups draw from the pool ("uniform", or "hardest": the pool
    curator of `simulators.Population`). `sim_baseline`: how the
    trained simulator's advantages are normalised (see `sim_baseline`; checked here, so that
    a configuration that cannot train the simulator fails before any rollout).
    """
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    if name in ("cotrain", "population"):
        resolve_sim_baseline(sim_reward, sim_baseline)
    opt = make_optimizer(policy.model, policy.adapter, policy_cfg)
    m = Method(name, policy, None, opt, policy_cfg, sim_baseline=sim_baseline)
    base = frozen[0] if frozen else None
    if name == "single":
        m.partner = base
    elif name == "vs":
        m.partner = Verbalized(base, k=vs_k, mode=vs_mode, seed=seed)
    elif name == "ensemble":
        m.partner = Ensemble(frozen, seed=seed)
    elif name == "persona" and getattr(base, "served", False):   # an OpenAI-compatible endpoint
        from .served import ServedPersonaGuided

        m.partner = ServedPersonaGuided(base, personas or [], seed=seed)
    elif name == "persona":
        m.partner = PersonaGuided(base.model, base.tokenizer, personas or [], base.adapter,
                                  base.temperature, base.max_new_tokens, seed=seed)
    elif name in ("cotrain", "population"):
        if sim_model is None:
            raise ValueError(f"method {name!r} needs a trainable simulator model (sim_model)")
        temperature = sim_temperature if sim_temperature is not None else base.temperature if base else 1.0
        kw = dict(reward=sim_reward, temperature=temperature,
                  max_new_tokens=base.max_new_tokens if base else 64)
        m.partner = (Trainable(sim_model, sim_tokenizer, **kw) if name == "cotrain" else
                     Population(sim_model, sim_tokenizer, size=pool_size, every=pool_every, seed=seed,
                                draw=pool_draw, **kw))
        m.sim_cfg = sim_cfg or UpdateConfig()
        m.sim_opt = make_optimizer(sim_model, "simulator", m.sim_cfg)
    elif name == "selfplay":
        m.partner = LMSpeaker(policy.model, policy.tokenizer, "partner", policy.adapter,
                              policy.temperature, policy.max_new_tokens, name="self")
    elif name == "population-selfplay":
        m.partner = Population(policy.model, policy.tokenizer, adapter=policy.adapter,
                               reward="shared", size=pool_size, every=pool_every, seed=seed,
                               temperature=policy.temperature, max_new_tokens=policy.max_new_tokens)
    elif name == "oracle":
        if oracle is None:
            raise ValueError("method 'oracle' needs a scripted partner (the environment's real users)")
        m.partner = oracle
    return m


SIM_BASELINES = ("auto", "group", "batch")


def resolve_sim_baseline(reward: str, baseline: str = "auto") -> str:
    """How the simulator's advantages are normalised for simulator reward `reward`.

    group: z-scored within each rollout group (the same task), like the policy's. With the
           adversarial reward this gives exactly -A_policy: the simulator is credited for
           making *this* task fail more often than its other rollouts, not for how hard the
           task is (a batch-wide baseline would reward it for being handed hard tasks).
    batch: z-scored over the whole batch. The curriculum reward is one value per group, so
           its group-wise advantages are all 0: it needs the batch baseline.
    auto:  group for adversarial / cooperative / shared, batch for curriculum.

    Curriculum with "group" is refused: the simulator would never receive a signal.
    """
    if baseline not in SIM_BASELINES:
        raise ValueError(f"unknown simulator baseline {baseline!r}; use {', '.join(SIM_BASELINES)}")
    if baseline == "auto":
        return "batch" if reward == "curriculum" else "group"
    if baseline == "group" and reward == "curriculum":
        raise ValueError("the curriculum simulator reward is constant within each rollout group, so a "
                         "group-wise baseline gives it zero advantages and the simulator never learns; "
                         "use the batch baseline (the default, 'auto') or another simulator reward")
    return baseline


def simulator_advantages(sim_rewards: torch.Tensor, group_size: int, reward: str,
                         baseline: str = "auto", std_floor: float = 0.0) -> torch.Tensor:
    """Advantages of the trained simulator's episodes (see `resolve_sim_baseline`)."""
    if resolve_sim_baseline(reward, baseline) == "group":
        return group_advantages(sim_rewards, group_size, std_floor=std_floor)[0]
    from . import distributed

    if distributed.active():      # torchrun: the baseline of every rank's batch together
        n = distributed.all_sum(float(sim_rewards.numel()))
        mean = distributed.all_sum(sim_rewards.sum()) / n
        std = (distributed.all_sum(((sim_rewards - mean) ** 2).sum()) / n).sqrt()
        return torch.zeros_like(sim_rewards) if std < 1e-6 else (sim_rewards - mean) / std
    std = sim_rewards.std(unbiased=False)
    return torch.zeros_like(sim_rewards) if std < 1e-6 else (sim_rewards - sim_rewards.mean()) / std


def anchor_step(m: Method) -> float:
    """One weighted SFT step of the trainable simulator on real transcripts; returns the NLL."""
    from .adapters import trainable_parameters, use_adapter
    from .sft import nll

    model, adapter = m.partner.model, m.partner.trainable_adapter
    ids, attn, mask = (t.to(next(model.parameters()).device) for t in m.anchor())
    m.anchor_tokens = (int(attn.sum().item()), int(mask[:, 1:].sum().item()))
    params = trainable_parameters(model, adapter)   # as in grpo_update: only this adapter
    model.train()
    m.sim_opt.zero_grad(set_to_none=True)
    with use_adapter(model, adapter):
        loss = nll(model, ids, attn, mask)
        # backward inside the block: on exit peft marks the model's default adapter trainable,
        # which is the policy's when both share one base
        (m.anchor_weight * loss).backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, m.sim_cfg.grad_clip))
    if math.isfinite(loss.item()) and math.isfinite(grad_norm):
        m.sim_opt.step()
        round_parameters(params)          # float64 (the toy's) only: minscope/precision.py
        m.sim_opt.nonfinite_streak = 0
    else:                     # as in grpo_update: never apply a NaN/inf step (counted, then stops)
        m.anchor_skipped += 1
        skip_step(m.sim_opt, adapter)
    model.eval()
    return loss.item()


def selfplay_partner_advantages(rewards: torch.Tensor, group_size: int, env) -> torch.Tensor:
    """Advantages of the turns the policy played as the partner in self-play.

    On a symmetric task both players share the task reward. On an asymmetric one (P4G's
    persuadee, tau2's user) the partner's interest is the opposite of the agent's: its
    reward is the opponent's, 1 - r, normalised within the group like every reward (which
    makes it -A wherever the group's rewards differ).
    """
    shared = getattr(env, "symmetric", False)
    return group_advantages(rewards if shared else 1.0 - widen(rewards), group_size)[0]


def partner_turns_as_agent(episodes: list[Episode]) -> list[Episode]:
    """Stand-ins for `episodes` whose "agent" stream is the partner's stream, so that the
    self-play policy's partner tokens join its agent tokens in ONE `grpo_update` (one
    optimiser step, like every other method). An episode without a partner stream gets a
    stand-in without streams, which `training_batch` leaves out."""
    out = []
    for ep in episodes:
        streams = ep.info.get("streams", {})
        out.append(Episode(task=ep.task, group=ep.group, reward=ep.reward,
                           info={"streams": {"agent": streams["partner"]} if "partner" in streams else {}}))
    return out


def ratio_by_age(pool, episodes, rows: dict, step: int) -> dict:
    """Population's simulator update, per age of the snapshot that played the episodes
    (`step` minus the step the snapshot is labelled with): trained tokens, the fraction of
    them the first pass clips, and their mean |log importance ratio|. A snapshot labelled
    k > 0 is taken after update k, the first one (label 0) before any update, so the live
    adapter is age - 1 updates past the first kind and age past the second (the report
    counts updates: `report_results.sim_update_summary`)."""
    step_of = {slot: snap for slot, (snap, _) in zip(pool.slots, pool.pool)}
    out: dict[str, list] = {}
    for i, (n, clipped, abs_log) in rows.items():
        age = step - step_of.get(episodes[i].partner_name, step)
        acc = out.setdefault(str(age), [0, 0, 0.0])
        acc[0], acc[1], acc[2] = acc[0] + n, acc[1] + clipped, acc[2] + abs_log
    return {age: {"tokens": int(n), "clip_frac": c / n if n else 0.0, "abs_log_ratio": a / n if n else 0.0}
            for age, (n, c, a) in sorted(out.items(), key=lambda kv: int(kv[0]))}


def train_step(method: Method, env, tasks, group_size: int, step: int, first_group: int = 0,
               seed: int | None = None) -> dict:
    """One step of any method. Returns a flat dict of metrics for metrics.jsonl.

    first_group: the number of the first task's group (a torchrun rank's share starts
    later); seed: the rollout chunks' random streams (see `rollout`)."""
    m = method
    pad = m.policy.tokenizer.pad_token_id
    if isinstance(m.partner, Verbalized):
        m.partner.stats.reset()           # the vs_* metrics count this step's rollout only
    episodes = rollout(env, tasks, m.policy, m.partner, group_size, first_group=first_group, seed=seed)
    if isinstance(m.partner, Population):
        m.partner.observe(episodes)       # before any snapshot moves the pool's slots
        # which snapshot played each group (in group order), and whether all K were in play
        pool_played = m.partner.played_by(episodes[::group_size])
        pool_full = len(m.partner.pool) == m.partner.size
    # float64 for the toy's float64 models, whose numbers must not depend on the CPU (precision.py)
    rewards = torch.tensor([ep.reward for ep in episodes], dtype=work_dtype(m.policy.model))
    floor = getattr(env, "reward_std_floor", 0.0)      # continuous rewards (P4G's read ones)
    adv, zero_var = group_advantages(rewards, group_size, std_floor=floor)
    train_eps, train_adv = episodes, adv
    if m.name == "selfplay":   # the policy played both roles: one update on both roles' tokens
        train_eps = episodes + partner_turns_as_agent(episodes)
        train_adv = torch.cat([adv, selfplay_partner_advantages(rewards, group_size, env)])
    p = grpo_update(m.policy.model, m.policy.adapter, m.policy_opt, train_eps, "agent", train_adv,
                    m.policy_cfg, pad)
    s = None
    metrics = {"step": step, "train_reward": rewards.mean().item(),
               "zero_var_frac": zero_var.float().mean().item(), "policy_entropy": p["entropy"],
               "clip_frac": p["clip_frac"], "kl": p["kl"], "policy_loss": p["loss"],
               "grad_norm": p["grad_norm"], "skipped_steps": p["skipped_steps"],   # non-finite updates
               "ratio_dev_max": p.get("ratio_dev_max"),     # the first pass's largest |ratio - 1|
               "score_errors": sum("score_error" in ep.info for ep in episodes),   # scored 0 (rollout)
               # UpdateConfig.skip_zero_signal: no group had a reward signal, nothing was computed
               "skipped_update": bool(p.get("skipped_update", False))}
    if p.get("skipped_update"):
        metrics["skip_reason"] = p["skip_reason"]
    if floor:       # where the groups' spreads sit against the floor (min, median, max)
        spread = rewards.view(-1, group_size).std(dim=1, unbiased=False).sort().values
        metrics["group_std"] = [spread[0].item(), spread[len(spread) // 2].item(), spread[-1].item()]
    if m.trains_simulator:
        # The simulator is paid for what it did: where the policy's reward is an expectation
        # over the simulator's own decision (P4G's read reward), the simulator's reward is built
        # from the decision it sampled (`env.partner_reward_key`), or its decision tokens' advantage
        # would not depend on the decision (DESIGN_NOTES, "The persuadee's decision").
        key = getattr(env, "partner_reward_key", None)
        basis = rewards if key is None else torch.tensor([ep.info.get(key, ep.reward) for ep in episodes],
                                                         dtype=rewards.dtype)
        sim_r = simulator_rewards(basis, group_size, m.partner.reward)
        sim_adv = simulator_advantages(sim_r, group_size, m.partner.reward, m.sim_baseline, std_floor=floor)
        population = isinstance(m.partner, Population)
        s = grpo_update(m.partner.model, m.partner.trainable_adapter, m.sim_opt, episodes, "partner",
                        sim_adv, m.sim_cfg, m.partner.tokenizer.pad_token_id, row_stats=population,
                        sampled_by=m.partner.adapter_of)
        metrics.update(sim_reward=sim_r.mean().item(), sim_entropy=s["entropy"], sim_clip_frac=s["clip_frac"],
                       sim_grad_norm=s["grad_norm"], sim_skipped_update=bool(s.get("skipped_update", False)),
                       sim_ratio_dev_max=s.get("ratio_dev_max"))
        if population:         # the off-policy update, measured: its ratios by the age of the snapshot that played
            metrics["sim_ratio_by_age"] = ratio_by_age(m.partner, episodes, s.pop("rows", {}), step)
        metrics["skipped_steps"] += s["skipped_steps"]
        if m.anchor is not None:
            skipped_before = m.anchor_skipped
            metrics["sim_anchor_nll"] = anchor_step(m)
            metrics["skipped_steps"] += m.anchor_skipped - skipped_before
    if isinstance(m.partner, Population):
        if step > 0 and step % m.partner.every == 0:
            m.partner.snapshot(step)
        metrics["pool_size"] = len(m.partner.pool)          # after this step's snapshot
        metrics["pool_played"], metrics["pool_full"] = pool_played, pool_full
        metrics["pool_scores"] = {str(k): round(v, 4) for k, v in sorted(m.partner.scores.items())}
        metrics["pool_mb"] = m.partner.pool_nbytes() / 2**20
    if isinstance(m.partner, Verbalized):
        metrics.update({f"vs_{k}": v for k, v in m.partner.stats.as_dict().items()})
    metrics["served_by"] = dict(Counter(ep.partner_name for ep in episodes[::group_size]))
    metrics["compute"] = step_compute(m, episodes, p, s)     # this step's tokens and FLOPs
    metrics["_episodes"] = episodes       # for transcripts; dropped before logging
    return metrics
