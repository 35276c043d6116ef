"""Copy it, change it: changes a user makes in a copy of a script, made here in code, and checked in the modes they
meet (docs/modifying.md lists the modification points)."""

import pytest
import torch

from conftest import SCRIPTS, import_script


def small_args(module, **flags):
    """A few iterations on the CPU: REINFORCE's rollouts run until every env has ended an episode (500 steps)."""
    steps, total = (500, 12_000) if module.__name__ == "reinforce" else (16, 32 * 16 * 4)
    return module.Args(num_envs=32, num_steps=steps, total_timesteps=total, target_return=None, eval_episodes=0,
                       progress_bar=False, device="cpu", **flags)  # fmt: skip


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_param_group_is_annealed_from_its_own_first_rate(name, in_tmp, monkeypatch):
    """Two param groups (the first layer at a tenth of the rate, say): both anneal, each from its own rate. Before,
    only the first group's rate was annealed (CleanRL's scripts have the same trap)."""
    module, made, adam = import_script(name), [], torch.optim.Adam

    def two_groups(params, lr, **kwargs):
        params = list(params)
        made.append(adam([{"params": params[:2], "lr": lr / 10}, {"params": params[2:]}], lr=lr, **kwargs))
        return made[-1]

    monkeypatch.setattr(module.torch.optim, "Adam", two_groups)
    args = small_args(module)
    module.train(args)
    first, rest = (group["lr"] for group in made[0].param_groups)
    assert 0 < rest < args.learning_rate and first == pytest.approx(rest / 10, rel=1e-12)
