"""vpg.py: the importance-weighted loss reduces to plain VPG on a rollout's first use."""

import torch

import vpg as V


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
        old_logprobs, _, _ = agent.evaluate(obs, actions)  # as after a rollout: pi_old = pi
    loss, stats = V.vpg_loss(agent, args, obs, actions, old_logprobs, advantages, returns)
    expected = plain_vpg_loss(agent, args, obs, actions, advantages, returns)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    assert stats[3].item() == 0.0  # approx KL of pi against itself
    grads = torch.autograd.grad(loss, list(agent.parameters()))
    expected_grads = torch.autograd.grad(expected, list(agent.parameters()))
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


def test_later_uses_are_importance_weighted_and_clipped():
    torch.manual_seed(0)
    agent = V.Agent(4, 2)
    obs, actions, advantages, returns = batch(1)
    with torch.no_grad():
        logprobs, _, _ = agent.evaluate(obs, actions)
    old_logprobs = logprobs + torch.linspace(-1.0, 1.0, len(logprobs))  # pi/pi_old from e^-1 to e^1
    args = V.Args(norm_adv=False, ent_coef=0.0, vf_coef=0.0, clip_coef=0.2)
    loss, _ = V.vpg_loss(agent, args, obs, actions, old_logprobs, advantages, returns)
    weights = (logprobs - old_logprobs).exp().clamp(0.8, 1.2)
    torch.testing.assert_close(loss, -(weights * logprobs * advantages).mean(), atol=1e-6, rtol=1e-6)
    unclipped, _ = V.vpg_loss(agent, V.Args(norm_adv=False, ent_coef=0.0, vf_coef=0.0, clip_coef=None),
                              obs, actions, old_logprobs, advantages, returns)  # fmt: skip
    torch.testing.assert_close(unclipped, -((logprobs - old_logprobs).exp() * logprobs * advantages).mean())
    assert not torch.isclose(loss, unclipped)


def test_rollout_reuse_trains(in_tmp):
    """K = 4 uses of each rollout run and log a nonzero KL after the first step."""
    args = V.Args(rollout_use_count=4, total_timesteps=20_000, progress_bar=False, eval_episodes=0, target_return=None)
    agent = V.train(args)
    assert isinstance(agent, V.Agent)
