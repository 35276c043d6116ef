"""Probe environments pin down the value function and the policy exactly (see probes.py)."""

import pytest
import torch

import ppo_cartpole_gpu as P
from probes import PROBES

GAMMA = 0.99
# (observations, expected values, expected action probabilities or None, tolerance)
EXPECTED = {
    1: ([[0.0]], [1.0], None, 1e-3),
    2: ([[-1.0], [1.0]], [-1.0, 1.0], None, 1e-3),
    3: ([[0.0], [1.0]], [GAMMA, 1.0], None, 1e-3),
    4: ([[0.0]], [1.0], [[0.0, 1.0]], 2e-3),
    5: ([[0.0], [1.0]], [1.0, 1.0], [[1.0, 0.0], [0.0, 1.0]], 2e-3),
}


def probe_args(**overrides) -> P.Args:
    args = dict(
        env_id="probe", total_timesteps=40_000, num_envs=128, num_steps=8, num_minibatches=4, update_epochs=4,
        learning_rate=1e-2, gamma=GAMMA, ent_coef=0.0, target_return=None, eval_episodes=0, progress_bar=False,
        device="cpu",
    )  # fmt: skip
    args.update(overrides)
    return P.Args(**args)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_probe(k, in_tmp):
    args = probe_args(seed=k)
    agent = P.train(args, envs=PROBES[k](args.num_envs, "cpu", seed=k))
    obs, values, probs, tol = EXPECTED[k]
    obs = torch.tensor(obs)
    with torch.no_grad():
        torch.testing.assert_close(agent.get_value(obs), torch.tensor(values), atol=tol, rtol=0)
        if probs is not None:
            torch.testing.assert_close(agent.actor(obs).softmax(-1), torch.tensor(probs), atol=tol, rtol=0)


def test_probe_fails_with_a_broken_agent(in_tmp):
    """The probe check can fail: with no learning at all, probe 1's value is far from 1."""
    args = probe_args(learning_rate=1e-9, total_timesteps=2048)
    agent = P.train(args, envs=PROBES[1](args.num_envs, "cpu"))
    with torch.no_grad():
        assert abs(agent.get_value(torch.zeros(1, 1)).item() - 1.0) > 0.1
