"""vpg.py: the importance-weighted loss reduces to plain VPG on a rollout's first use; reuse takes more steps."""

import functools

import pytest
import torch

import vpg as V
from ladder.optim import Adam

pytestmark = pytest.mark.quick  # in the two-minute run: python -m pytest -m quick


def batch(seed=0, n=64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g),
            torch.randn(n, generator=g), torch.randn(n, generator=g))  # fmt: skip


def plain_vpg_loss(agent, args, obs, actions, advantages, returns):
    """Textbook VPG: -mean(log pi(a|s) * A) - c_ent H + c_vf * 0.5 * mean((V - R)^2)."""
    dist = torch.distributions.Categorical(logits=agent.actor(obs))
    adv = (advantages - advantages.mean()) / (advantages.std() + 1e-8) if args.norm_adv else advantages
    value = agent.critic(obs).squeeze(-1)
    return (-(dist.log_prob(actions) * adv).mean() - args.ent_coef * dist.entropy().mean()
            + args.vf_coef * 0.5 * (value - returns).square().mean())  # fmt: skip


def test_first_use_equals_plain_vpg_loss_and_gradient():
    torch.manual_seed(0)
    agent = V.Agent(4, 2)
    obs, actions, advantages, returns = batch()
    args = V.Args(ent_coef=0.01, clip_coef=0.2)
    with torch.no_grad():
        old_logprobs, _, _ = agent(obs, actions)  # as after a rollout: pi_old = pi
    loss, stats = V.vpg_loss(agent, args, V.Batch(obs, actions, old_logprobs, advantages, returns, None))
    expected = plain_vpg_loss(agent, args, obs, actions, advantages, returns)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    assert stats["losses/approx_kl"].item() == 0.0  # approx KL of pi against itself
    torch.testing.assert_close(stats["losses/total_loss"], expected.detach(), atol=1e-6, rtol=1e-6)
    grads = torch.autograd.grad(loss, list(agent.parameters()))
    expected_grads = torch.autograd.grad(expected, list(agent.parameters()))
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


def test_later_uses_are_importance_weighted_and_clipped():
    torch.manual_seed(0)
    agent = V.Agent(4, 2)
    obs, actions, advantages, returns = batch(1)
    with torch.no_grad():
        logprobs, _, _ = agent(obs, actions)
    old_logprobs = logprobs + torch.linspace(-1.0, 1.0, len(logprobs))  # pi/pi_old from e^-1 to e^1
    args = V.Args(norm_adv=False, ent_coef=0.0, vf_coef=0.0, clip_coef=0.2)
    loss, _ = V.vpg_loss(agent, args, V.Batch(obs, actions, old_logprobs, advantages, returns, None))
    weights = (logprobs - old_logprobs).exp().clamp(0.8, 1.2)
    torch.testing.assert_close(loss, -(weights * logprobs * advantages).mean(), atol=1e-6, rtol=1e-6)
    unclipped, _ = V.vpg_loss(agent, V.Args(norm_adv=False, ent_coef=0.0, vf_coef=0.0, clip_coef=None),
                              V.Batch(obs, actions, old_logprobs, advantages, returns, None))  # fmt: skip
    torch.testing.assert_close(unclipped, -((logprobs - old_logprobs).exp() * logprobs * advantages).mean())
    assert not torch.isclose(loss, unclipped)


STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "total_loss", "explained_variance")


def cartpole_batch(agent, args) -> V.Batch:
    """A real batch: one rollout of the CartPole under `agent`, its advantages and returns, as `train` makes it."""
    T, N = args.num_steps, args.num_envs
    envs = V.CartPole(N, "cpu", seed=0)
    rollout = V.Rollout.empty(T, N, envs.obs_dim, "cpu")
    V.collect_rollout(agent, envs, envs.reset()[0], rollout, V.RolloutNoise.draw(envs, T))
    b_obs, b_actions = rollout.obs.view(T * N, -1), rollout.actions.view(T * N)
    with torch.no_grad():
        b_logprobs, _, b_values = agent(b_obs, b_actions)
        next_values = agent.get_value(rollout.final_obs.view(T * N, -1)).view(T, N)
    values, gae = b_values.view(T, N), (args.gamma, args.gae_lambda)
    advantages, returns = V.compute_gae(rollout.rewards, values, next_values, rollout.terminated, rollout.dones, *gae)
    batch = V.Batch(b_obs, b_actions, b_logprobs, advantages.view(-1), returns.view(-1), b_values)
    for mine, theirs in zip(V.make_batch(agent, rollout, args), batch):  # `make_batch` is these lines
        torch.testing.assert_close(mine, theirs)
    return batch


@pytest.mark.parametrize("uses", [1, 4])
def test_rollout_reuse_takes_importance_weighted_steps(uses, monkeypatch):
    """`update` takes `rollout-use-count` gradient steps on the batch: the first on-policy (KL 0), the later
    ones away from pi_old (KL > 0), and it reports their mean statistics and the explained variance."""
    torch.manual_seed(0)
    agent = V.Agent(4, 2)
    args = V.Args(num_envs=32, num_steps=16, rollout_use_count=uses)
    batch = cartpole_batch(agent, args)
    before = [p.detach().clone() for p in agent.parameters()]
    optimizer = Adam(agent, lr=args.learning_rate, eps=1e-5)
    calls = []
    gradient_step = functools.partial(
        V.gradient_step, agent, optimizer, lambda *a: calls.append(a) or V.vpg_loss(*a), args
    )
    stats = V.update(gradient_step, batch, args)
    assert len(calls) == uses
    assert set(stats) == {f"losses/{name}" for name in STATS}
    assert all(torch.isfinite(value) for value in stats.values())
    if uses == 1:
        assert stats["losses/approx_kl"].item() == 0.0
    else:
        assert stats["losses/approx_kl"].item() > 1e-4  # 0.005 here
    assert all(not torch.equal(p, q) for p, q in zip(agent.parameters(), before))
    torch.testing.assert_close(stats["losses/explained_variance"], V.explained_variance(batch.values, batch.returns))


def test_explained_variance_is_nan_for_constant_returns():
    assert V.explained_variance(torch.randn(10), torch.ones(10)).isnan()
    returns = torch.arange(10.0)
    assert V.explained_variance(returns, returns).item() == 1.0
    assert V.explained_variance(torch.zeros(10), returns).item() == 0.0
