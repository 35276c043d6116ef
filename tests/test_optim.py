"""ladder/optim.py: its Adam, which holds the parameters as views of one flat vector, takes the step torch.optim's
AdamW takes (with clip_grad_norm_, two param groups at their own rates), eager and compiled, through the script's
`gradient_step`; and a run that does not compile never imports torch._dynamo (~0.9 s)."""

import copy
import subprocess
import sys

import pytest
import torch
import torch._dynamo

from conftest import ROOT, assert_same_agents, compiled_as_in_a_run, import_script
from ladder.flags import UsageError
from ladder.optim import Adam


def fixed_batch(mod, n: int = 64):
    return mod.Batch(torch.randn(n, 4), torch.randint(0, 2, (n,)), torch.randn(n) - 0.7, torch.randn(n),
                     torch.randn(n), torch.randn(n))  # fmt: skip


def torch_step(agent, optimizer, loss_fn, args, batch, idx=None) -> dict:
    """The gradient step as torch.optim takes it: backward(), clip_grad_norm_, the optimizer's step()."""
    loss, stats = loss_fn(agent, args, batch if idx is None else type(batch)(*(x[idx] for x in batch)))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return stats


@pytest.mark.parametrize("name", ["ppo_cartpole_gpu", "vpg"])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
@pytest.mark.parametrize("compile", [False, True])
def test_the_gradient_step_is_torch_adam_with_clipping(name, weight_decay, compile):
    """The script's `gradient_step` (ladder's Adam: the gradient in the flat parameter vector, the update written
    out) equals loss.backward, clip_grad_norm_ and torch.optim.Adam's step (AdamW's with weight decay), eager and
    compiled, with two param groups of their own rates, on minibatches given by index."""
    mod = import_script(name)
    torch.manual_seed(0)
    args = mod.Args(max_grad_norm=0.05)  # small enough that the clipping acts
    agent = mod.Agent(4, 2)
    twin = copy.deepcopy(agent)
    groups = lambda a: [{"params": a.actor.parameters()}, {"params": a.critic.parameters(), "lr": 3e-3}]
    opt = Adam(agent, groups(agent), lr=1e-2, eps=1e-5, weight_decay=weight_decay)
    twin_opt = torch.optim.AdamW(groups(twin), lr=1e-2, eps=1e-5, weight_decay=weight_decay)
    loss_fn, batch = mod.ppo_loss if name == "ppo_cartpole_gpu" else mod.vpg_loss, fixed_batch(mod)
    torch._dynamo.reset()
    step = compiled_as_in_a_run(mod.gradient_step) if compile else mod.gradient_step
    for _ in range(3):
        idx = torch.randperm(len(batch.obs))[:32]
        stats, twin_stats = (
            step(agent, opt, loss_fn, args, batch, idx),
            torch_step(twin, twin_opt, loss_fn, args, batch, idx),
        )
        for tag in stats:
            torch.testing.assert_close(stats[tag], twin_stats[tag], atol=1e-6, rtol=1e-5)
    assert_same_agents(agent, twin, "compiled" if compile else "resumed", atol=2e-6, rtol=1e-5)
    assert float(opt.state["flat"]["step"]) == 3


@pytest.mark.quick
def test_a_default_run_does_not_import_torch_dynamo(tmp_path):
    """torch.optim wraps add_param_group in _disable_dynamo, whose first call imports torch._dynamo: ~0.9 s of a
    default run's 4.6 s from launch to result (2-core AMD EPYC). ladder's Adam calls the unwrapped function, so a run
    without --compile never imports it (here: the set-up, and an iteration's gradient step)."""
    code = (
        "import sys, torch; sys.path.insert(0, {root!r}); import ppo_cartpole_gpu as P; from ladder.optim import Adam; "
        "agent = P.Agent(4, 2); optimizer = Adam(agent, lr=1e-3); "
        "loss = lambda agent, obs: (agent.get_value(obs).square().mean(), {{}}); "
        "optimizer.zero_grad(); optimizer.backward(loss, agent, torch.ones(3, 4)); "
        "torch.nn.utils.clip_grad_norm_(agent.parameters(), 0.5, foreach=False); optimizer.step(); "
        "print('torch._dynamo' in sys.modules)"
    ).format(root=ROOT)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


@pytest.mark.quick
def test_adam_keeps_torch_optimizers_contract():
    """ladder's Adam as torch.optim's: step(closure) returns the closure's loss and steps on the `.grad` it left,
    zero_grad() sets None (or zeros with set_to_none=False), state_dict's hooks run, an lr scheduler sets the rate in
    place; a step or load hook is refused in one line (the step is compiled and vmapped), and so is a step with no
    gradient (torch's would skip it silently)."""
    P = import_script("ppo_cartpole_gpu")
    torch.manual_seed(0)
    agent = P.Agent(4, 2)
    optimizer = Adam(agent, lr=1e-2)
    before = [p.detach().clone() for p in agent.parameters()]

    def closure():
        optimizer.zero_grad()
        loss = agent.get_value(torch.ones(3, 4)).square().mean()
        loss.backward()
        return loss

    assert torch.is_tensor(optimizer.step(closure))
    assert any(not torch.equal(p, q) for p, q in zip(agent.parameters(), before))
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is None or not p.grad.any() for p in agent.parameters())
    optimizer.zero_grad()
    assert all(p.grad is None for p in agent.parameters())
    seen = []
    optimizer.register_state_dict_post_hook(lambda opt, state: seen.append(sorted(state["state"])))
    assert sorted(optimizer.state_dict()) == ["param_groups", "state"] and seen == [["flat"]]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5**epoch)
    rate = optimizer.param_groups[0]["lr"]
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] is rate and float(rate) == pytest.approx(5e-3)
    for register in (optimizer.register_step_pre_hook, optimizer.register_load_state_dict_post_hook):
        with pytest.raises(UsageError, match="runs no step or load hooks"):
            register(lambda *args: None)
    with pytest.raises(UsageError, match="found no gradient"):
        optimizer.step()
