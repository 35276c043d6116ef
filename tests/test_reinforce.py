"""reinforce.py: reward-to-go returns, the loss, and rollouts that train on and log unbiased episodes."""

import numpy as np
import pytest
import torch

import reinforce as R
from reference import reference_returns

pytestmark = pytest.mark.quick  # in the two-minute run: python -m pytest -m quick

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
    """Over the steps the batch's mask keeps (each env's first episode), as the same loss over those rows alone."""
    torch.manual_seed(0)
    agent = R.Agent(4, 2)
    obs, actions, returns = torch.randn(50, 4), torch.randint(0, 2, (50,)), torch.randn(50) * 3 + 1
    first = (torch.rand(50) < 0.6).float()
    args = R.Args(normalize_returns=True, ent_coef=0.0)
    loss, stats = R.reinforce_loss(agent, args, R.Batch(obs, actions, returns, first))
    kept = first > 0
    logp = torch.distributions.Categorical(logits=agent.actor(obs[kept])).log_prob(actions[kept])
    g = returns[kept]
    expected = -(logp * (g - g.mean()) / g.std(correction=0)).mean()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert set(stats) == {"losses/policy_loss", "losses/entropy", "losses/total_loss"}
    torch.testing.assert_close(stats["losses/total_loss"], expected.detach(), atol=1e-5, rtol=1e-5)
    raw, _ = R.reinforce_loss(agent, R.Args(normalize_returns=False), R.Batch(obs, actions, returns, first))
    torch.testing.assert_close(raw, -(logp * g).mean(), atol=1e-6, rtol=1e-6)


def record(monkeypatch, args: R.Args):
    """Train with `args`, recording each rollout as collected, each batch trained on, and the env steps
    and the episodes (return, length) each `Run.log` call counts."""
    rollouts, batches, logs = [], [], []
    collect_episodes, gradient_step, log = R.collect_episodes, R.gradient_step, R.Run.log

    def recording_collect(collect, run, agent, envs, storage):
        steps = collect_episodes(collect, run, agent, envs, storage)
        rollouts.append(R.Rollout(*(x[:steps].clone() for x in storage)))
        return steps

    def recording_gradient_step(agent, optimizer, loss_fn, args, batch, idx=None):
        batches.append(type(batch)(*(x.clone() for x in batch)))  # (views of the storage the next rollout fills)
        return gradient_step(agent, optimizer, loss_fn, args, batch, idx)

    def recording_log(run, env_steps, stats, episodes):
        ended, returns, lengths = episodes
        logs.append((env_steps, returns[ended].clone(), lengths[ended].clone()))
        return log(run, env_steps, stats, episodes)

    monkeypatch.setattr(R, "collect_episodes", recording_collect)
    monkeypatch.setattr(R, "gradient_step", recording_gradient_step)
    monkeypatch.setattr(R.Run, "log", recording_log)
    R.train(args)
    assert len(rollouts) == len(batches) == len(logs)
    return rollouts, batches, logs


def test_rollouts_train_on_and_log_each_envs_first_episode(in_tmp, monkeypatch):
    """Every trained transition lies in its env's first episode of the rollout, all of each first episode
    is trained on, exactly one episode per env is logged, and every simulated step counts. A rollout
    stops within 10 steps of every env having finished an episode."""
    N = 16
    args = R.Args(num_envs=N, total_timesteps=20_000, progress_bar=False, eval_episodes=0, target_return=None)
    rollouts, batches, logs = record(monkeypatch, args)
    assert len(rollouts) > 5
    later_episodes = 0
    for rollout, batch, (env_steps, returns, lengths) in zip(rollouts, batches, logs):
        dones = rollout.dones.numpy()
        steps = len(dones)
        assert dones.any(0).all()
        first_end = dones.argmax(0)  # per env, the step its first episode ends on
        assert first_end.max() + 1 <= steps < first_end.max() + 11
        later_episodes += int(dones.sum()) - N
        in_first = np.arange(steps)[:, None] <= first_end[None, :]  # (T, N), time-major as the batch
        trained = batch.first.numpy() > 0  # the mask over the T*N rows (time-major)
        np.testing.assert_array_equal(trained, in_first.reshape(-1))
        np.testing.assert_array_equal(batch.obs.numpy()[trained], rollout.obs.numpy()[in_first])
        np.testing.assert_array_equal(batch.actions.numpy()[trained], rollout.actions.numpy()[in_first])
        expected_returns = reference_returns(rollout.rewards.numpy(), dones, args.gamma)[in_first]
        np.testing.assert_allclose(batch.returns.numpy()[trained], expected_returns, rtol=1e-5)
        assert env_steps == steps * N
        assert sorted(lengths.tolist()) == sorted((first_end + 1).tolist())
        assert sorted(returns.tolist()) == sorted((first_end + 1.0).tolist())  # CartPole: +1 a step
    assert later_episodes > len(rollouts)  # later episodes existed, and were left out


def random_policy_first_episode_lengths(n: int, seed: int) -> torch.Tensor:
    """Length of the first episode of each of `n` CartPoles under the uniformly random policy."""
    env = R.CartPole(n, "cpu", seed)
    env.reset()
    actions = torch.Generator().manual_seed(seed)
    lengths = torch.zeros(n, dtype=torch.int32)
    while (lengths == 0).any():
        _, _, terminated, truncated, info = env.step(torch.randint(0, 2, (n,), generator=actions))
        lengths = torch.where((terminated | truncated) & (lengths == 0), info["episode_length"], lengths)
    return lengths.float()


def test_trained_and_logged_episodes_are_unbiased(in_tmp, monkeypatch):
    """With a policy that stays near uniform (learning rate 1e-9), the episodes trained on and logged have
    the mean length of the random policy's episodes (here within 1%). Also keeping the later episodes that
    end before the slowest env's first one, as reinforce.py once did, biased them 8% short here."""
    reference = random_policy_first_episode_lengths(20_000, seed=123).mean().item()  # ~22.4, standard error ~0.1
    frozen = dict(learning_rate=1e-9, progress_bar=False, eval_episodes=0, target_return=None)
    args = R.Args(num_envs=256, total_timesteps=200_000, seed=5, **frozen)
    _, batches, logs = record(monkeypatch, args)
    lengths = torch.cat([lengths for _, _, lengths in logs]).float()
    assert len(lengths) >= 1500  # standard error of the mean ~12 / sqrt(1500) ~ 0.3, ~1.4% of it
    assert lengths.mean().item() == pytest.approx(reference, rel=0.04)
    assert sum(batch.first.sum().item() for batch in batches) == lengths.sum().item()  # trained: the same episodes


def test_num_steps_below_the_episode_limit_is_refused():
    with pytest.raises(R.UsageError, match="--num-steps must be at least the episode limit 500, got 100"):
        R.train(R.Args(num_steps=100, progress_bar=False, device="cpu"))
