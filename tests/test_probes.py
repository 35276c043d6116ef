"""Probe environments pin down the value function and the policy exactly (see probes.py).

PPO and VPG must learn all five; REINFORCE, which has no value function, probes 4 and 5.
"""

import importlib

import pytest
import torch

import ppo_cartpole_gpu as P
from conftest import origin, retarget
from probes import PROBES

pytestmark = pytest.mark.quick  # in the two-minute run: python -m pytest -m quick

GAMMA = 0.99
# (observations, expected values, expected action probabilities or None, tolerance)
EXPECTED = {
    1: ([[0.0]], [1.0], None, 1e-3),
    2: ([[-1.0], [1.0]], [-1.0, 1.0], None, 1e-3),
    3: ([[0.0], [1.0]], [GAMMA, 1.0], None, 1e-3),
    4: ([[0.0]], [1.0], [[0.0, 1.0]], 2e-3),
    5: ([[0.0], [1.0]], [1.0, 1.0], [[1.0, 0.0], [0.0, 1.0]], 2e-3),
}


def probe_args(module=P, **overrides):
    args = dict(
        env_id="probe", total_timesteps=40_000, num_envs=128, num_steps=8, learning_rate=1e-2, gamma=GAMMA,
        ent_coef=0.0, target_return=None, eval_episodes=0, progress_bar=False, device="cpu",
    )  # fmt: skip
    args.update(overrides)
    return module.Args(**args)


CASES = retarget(
    [("ppo_cartpole_gpu", k) for k in range(1, 6)]
    + [("vpg", k) for k in range(1, 6)]
    + [("reinforce", 4), ("reinforce", 5)]
)
OVERRIDES = {
    "ppo_cartpole_gpu": {"num_minibatches": 4, "update_epochs": 4},
    # one gradient step per rollout: smaller, more numerous rollouts
    "vpg": {"num_envs": 64, "num_steps": 4, "total_timesteps": 80_000},
    "reinforce": {},
}


@pytest.mark.behaviour
@pytest.mark.parametrize("script, k", CASES)
def test_probe(script, k, in_tmp):
    module = importlib.import_module(script)
    args = probe_args(module, seed=k, **OVERRIDES[origin(script)])
    agent = module.train(args, envs=PROBES[k](args.num_envs, "cpu", seed=k))
    obs, values, probs, tol = EXPECTED[k]
    obs = torch.tensor(obs)
    with torch.no_grad():
        if origin(script) == "reinforce":  # no critic: only the policy can be probed
            assert not hasattr(agent, "critic") and probs is not None
        else:
            torch.testing.assert_close(agent.get_value(obs), torch.tensor(values), atol=tol, rtol=0)
        if probs is not None:
            torch.testing.assert_close(agent.actor(obs).softmax(-1), torch.tensor(probs), atol=tol, rtol=0)


def test_probe_fails_with_a_broken_agent(in_tmp):
    """The probe check can fail: with no learning at all, probe 1's value is far from 1."""
    args = probe_args(learning_rate=1e-9, total_timesteps=2048)
    agent = P.train(args, envs=PROBES[1](args.num_envs, "cpu"))
    with torch.no_grad():
        assert abs(agent.get_value(torch.zeros(1, 1)).item() - 1.0) > 0.1
