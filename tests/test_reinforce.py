"""reinforce.py: reward-to-go returns and the loss over complete episodes."""

import numpy as np
import pytest
import torch

import reinforce as R
from reference import reference_returns

KNOWN_RETURNS = [1.9883, 3.9766, 5.9531, 7.9062, 9.8125, 11.625, 13.25, 14.5, 15.0, 14.0, 10.0]


def test_compute_returns_known_answer():
    """Rewards 0, 1, ..., 10 with the episode ending on the 10, twice in a row, gamma 0.5."""
    rewards = torch.arange(11.0).repeat(2).unsqueeze(1)
    dones = torch.zeros(22, 1, dtype=torch.bool)
    dones[10] = dones[21] = True
    returns = R.compute_returns(rewards, dones, 0.5)[:, 0]
    torch.testing.assert_close(returns, torch.tensor(KNOWN_RETURNS * 2), atol=1e-4, rtol=0)


def test_compute_returns_matches_reference_loop():
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(40, 9))
    dones = rng.random((40, 9)) < 0.15
    returns = R.compute_returns(torch.as_tensor(rewards), torch.as_tensor(dones), 0.9)
    np.testing.assert_allclose(returns.numpy(), reference_returns(rewards, dones, 0.9), rtol=1e-12, atol=1e-12)


def test_loss_is_minus_mean_logprob_times_normalised_return():
    torch.manual_seed(0)
    agent = R.Agent(4, 2)
    obs, actions, returns = torch.randn(50, 4), torch.randint(0, 2, (50,)), torch.randn(50) * 3 + 1
    args = R.Args(normalize_returns=True, ent_coef=0.0)
    loss, stats = R.reinforce_loss(agent, args, obs, actions, returns)
    logp = torch.distributions.Categorical(logits=agent.actor(obs)).log_prob(actions)
    expected = -(logp * (returns - returns.mean()) / returns.std(correction=0)).mean()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    raw, _ = R.reinforce_loss(agent, R.Args(normalize_returns=False), obs, actions, returns)
    torch.testing.assert_close(raw, -(logp * returns).mean(), atol=1e-6, rtol=1e-6)


def test_rollouts_train_only_on_complete_episodes(in_tmp, monkeypatch):
    """Every transition in the loss lies in an episode that finished inside its rollout, and a
    rollout stops within 10 steps of every env having finished one."""
    rollouts, batches = [], []
    real_returns, real_loss = R.compute_returns, R.reinforce_loss
    monkeypatch.setattr(R, "compute_returns", lambda r, d, g: rollouts.append(d.clone()) or real_returns(r, d, g))
    monkeypatch.setattr(R, "reinforce_loss", lambda agent, args, o, a, g: batches.append(len(g)) or real_loss(agent, args, o, a, g))
    R.train(R.Args(num_envs=16, total_timesteps=20_000, progress_bar=False, eval_episodes=0, target_return=None))
    assert len(rollouts) == len(batches) > 5
    for dones, batch in zip(rollouts, batches):
        per_env = dones.T.numpy()
        assert all(d.any() for d in per_env)
        assert batch == sum(int(np.flatnonzero(d)[-1]) + 1 for d in per_env)
        all_finished = max(int(np.flatnonzero(d)[0]) for d in per_env) + 1
        assert all_finished <= len(dones) < all_finished + 10


def test_num_steps_below_the_episode_limit_is_refused(in_tmp):
    with pytest.raises(R.UsageError, match="below the episode limit 500"):
        R.train(R.Args(num_steps=100, progress_bar=False))
