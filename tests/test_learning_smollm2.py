"""The honest end-to-end check on a real model: GRPO makes SmolLM2-135M-Instruct better.

The task is `numbers` (minscope/envs/numbers.py): the scripted asker says "Say a number
greater than 50." (or one of three rewordings), the policy answers once, the reward is 1 when
the first number in the answer is above 50. SmolLM2 answers so about one time in ten. The
policy is a fresh rank-8 LoRA on every linear layer, trained at train.py's real-model settings
(temperature 0.7, KL 0.005, 2 requests x G = 8 a step) but at lr 1e-3, twice train.py's default,
so that STEPS updates clear the margin with room, twice, from two seeds. Its success rate on a
fixed evaluation batch (every request PER_TASK times, one fixed random stream) must rise by MARGIN_SE standard errors of the
difference, which sampling noise does not reach. A broken update does not pass: with a zero
learning rate the adapter does not move and the rate is exactly the same; with the advantages'
sign flipped it fell, 0.094 -> 0.031 (docs/REAL_MODELS.md, "A real model learns";
`bench/learning_rate.py --broken sign`).
"""
import math

import pytest
from test_smollm2 import model_cache, smollm2_dir  # noqa: F401  (fixtures: the converted checkpoint)

from minscope import learning
from minscope.adapters import add_adapters
from minscope.envs.numbers import Numbers
from minscope.models import load_model
from minscope.real_args import SAMPLING_TEMPERATURE
from minscope.rollout import LMSpeaker

STEPS = 4
PER_TASK = 16            # 4 requests x 16 = 64 episodes in the evaluation batch
MAX_NEW_TOKENS = 12      # room for "The number is 73." and a little more
MARGIN_SE = 4
LR = 1e-3


@pytest.fixture(scope="module")
def numbers():
    return Numbers()


@pytest.fixture(scope="module")
def smol_policy(smollm2_dir):  # noqa: F811
    model, tok = load_model(str(smollm2_dir))
    model = add_adapters(model, ["policy"])
    policy = LMSpeaker(model, tok, "agent", adapter="policy", temperature=SAMPLING_TEMPERATURE,
                       max_new_tokens=MAX_NEW_TOKENS)
    return policy, learning.snapshot(policy)


@pytest.fixture(scope="module")
def before(smol_policy, numbers):
    """The untrained policy's success rate (a fresh LoRA adapter is the base model)."""
    policy, fresh = smol_policy
    learning.reset(policy, fresh)
    rate, _ = learning.success_rate(policy, numbers, numbers.tasks("train"), PER_TASK)
    return rate


def trained_rate(smol_policy, numbers, seed: int, lr: float = LR) -> tuple[float, list[float]]:
    policy, fresh = smol_policy
    learning.reset(policy, fresh)
    try:
        rewards = learning.train(policy, numbers, STEPS, lr, seed)
        rate, _ = learning.success_rate(policy, numbers, numbers.tasks("train"), PER_TASK)
    finally:
        learning.reset(policy, fresh)
    return rate, rewards


@pytest.mark.parametrize("seed", [0, 1])
def test_smollm2_learns_to_say_a_number_above_50(smol_policy, numbers, before, seed):
    n = len(numbers.tasks("train")) * PER_TASK
    after, rewards = trained_rate(smol_policy, numbers, seed)
    se = math.hypot(learning.standard_error(before, n), learning.standard_error(after, n))
    assert 0.02 < before < 0.4, before                 # SmolLM2 says a number above 50 now and then
    assert after - before > MARGIN_SE * se, (before, after, se, rewards)
