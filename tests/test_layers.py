"""Random and normalising layers a user adds to the MLP (LayerNorm before or after the activation, Dropout at several
places, AlphaDropout, noise drawn inside `forward`), in every compiled mode against eager: --compile, --num-seeds 2
--compile against --num-seeds 2, and the CUDA graph's replay (emulated on the CPU) with --compile. Under torch 2.13 a
compiled gradient by torch.func.grad read a mask of dropout after LayerNorm before drawing it: the hidden layer was 0
and nothing learned (issue 64; ladder/compile.py)."""

import glob
import os
from dataclasses import replace

import pytest
import torch
import torch._dynamo
import torch.nn as nn

from conftest import ROOT, assert_close, assert_same_agents, read_json, scalars, small_args, train_seeds
from ladder.flags import UsageError
from recipes import recipe_copy
from test_graph import replayed_on_the_cpu
from test_learning import BUDGET

HIDDEN = "    hidden = [layer_init(nn.Linear(in_dim, 64)), Tanh(), layer_init(nn.Linear(64, 64)), Tanh()]\n"
LAYERNORM_DROPOUT = [
    (HIDDEN, HIDDEN.replace("), Tanh(), layer_init", "), nn.LayerNorm(64), Tanh(), nn.Dropout(0.1), layer_init"))
]
"""The issue's copy: LayerNorm and Dropout in the first hidden layer of both networks, as a user writes them."""


class Noise(nn.Module):
    """Gaussian noise added in training, drawn inside `forward` (a noisy layer, as in NoisyNets without weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn_like(x) if self.training else x


class Gumbel(nn.Module):
    """Gumbel noise -log(-log U) added in training, drawn inside `forward`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - 0.1 * (-torch.rand_like(x).clamp_min(1e-20).log()).log() if self.training else x


LAYERS = {  # what follows the first hidden Linear of both networks
    "layernorm before tanh, dropout": lambda T: [nn.LayerNorm(64), T(), nn.Dropout(0.1)],
    "layernorm before tanh, alpha dropout": lambda T: [nn.LayerNorm(64), T(), nn.AlphaDropout(0.1)],
    "dropout before tanh": lambda T: [nn.Dropout(0.1), T()],
    "layernorm after tanh": lambda T: [T(), nn.LayerNorm(64)],
    "layernorm after tanh, dropout": lambda T: [T(), nn.LayerNorm(64), nn.Dropout(0.1)],
    "tanh, gaussian noise": lambda T: [T(), Noise()],
    "layernorm before tanh, gumbel noise": lambda T: [nn.LayerNorm(64), T(), Gumbel()],
}
DRAWS_NO_MASK = [kind for kind in LAYERS if "dropout" not in kind]
"""Layers with no dropout: --num-seeds with --compile refuses dropout on the CPU (ladder/stacked.py)."""


def with_layers(module, monkeypatch, *kinds: str) -> None:
    """The script's `mlp` with the layers of `kinds` after its first hidden Linear."""

    def mlp(in_dim: int, out_dim: int, out_std: float) -> nn.Sequential:
        first = [layer for kind in kinds for layer in LAYERS[kind](module.Tanh)]
        second = [module.layer_init(nn.Linear(64, 64)), module.Tanh()]
        head = module.layer_init(nn.Linear(64, out_dim), std=out_std)
        return nn.Sequential(module.layer_init(nn.Linear(in_dim, 64)), *first, *second, head)

    monkeypatch.setattr(module, "mlp", mlp)


def losses(tmp, exp_name: str) -> dict[str, torch.Tensor]:
    """Seed 1's losses of the run `exp_name`, an iteration each."""
    (folder,) = glob.glob(str(tmp / "runs" / f"*__{exp_name}__1__*"))
    return {tag: torch.tensor([v for _, v in values]) for tag, values in scalars(folder).items() if "losses/" in tag}


def assert_alike(tmp, runs: dict, compiled: str, eager: str) -> None:
    """The compiled run's agents (a seed each) and seed 1's losses, iteration by iteration, within the compiled-vs-eager
    tolerance of the other modification tests (test_modifications.assert_same_training)."""
    for mine, theirs in zip(runs[compiled], runs[eager], strict=True):
        assert_same_agents(mine, theirs, "compiled", atol=2e-4, rtol=1e-3)
    mine, theirs = losses(tmp, compiled), losses(tmp, eager)
    for tag, values in theirs.items():
        assert_close(mine[tag], values, f"{compiled}'s {tag} by iteration", atol=2e-4, rtol=1e-3)


def train_in_every_compiled_mode(module, tmp, dropout: str | None = None, one_run: bool = True) -> None:
    """Eager against --compile, the CUDA graph's replay with --compile, and two stacked seeds eager against compiled;
    with `dropout` (the class of the agent's first dropout layer) the last is refused in one line instead; without
    `one_run`, only the stacked seeds."""
    args = small_args(module, eval_episodes=0, total_timesteps=32 * 16 * 2)
    tiny = dict(num_steps=4, num_minibatches=1, update_epochs=1)  # (the stacked iteration is one graph: a small one)
    modes = {"eager": {}, "compiled": dict(compile=True)} if one_run else {}
    modes["stacked"], runs = dict(num_seeds=2, **tiny), {}
    for name, flags in modes.items():
        torch._dynamo.reset()
        runs[name] = train_seeds(module, replace(args, exp_name=name, **flags))
    if one_run:
        with pytest.MonkeyPatch.context() as patch:
            replayed_on_the_cpu(module, patch)
            torch._dynamo.reset()
            runs["replayed_compiled"] = [module.train(replace(args, exp_name="replayed_compiled", compile=True))]
        assert_alike(tmp, runs, "compiled", "eager")
        assert_alike(tmp, runs, "replayed_compiled", "eager")
    stacked = replace(args, exp_name="stacked_compiled", compile=True, **modes["stacked"])
    torch._dynamo.reset()
    if dropout is None:
        runs["stacked_compiled"] = train_seeds(module, stacked)
        assert_alike(tmp, runs, "stacked_compiled", "stacked")
    else:
        refusal = f"--num-seeds with --compile: torch 2.13's CPU compiler uses {dropout}'s masks before drawing them"
        with pytest.raises(UsageError, match=refusal):
            module.train(stacked)


def test_the_layernorm_dropout_copy_trains_as_eager_in_every_compiled_mode(in_tmp, monkeypatch):
    """The issue's copy of ppo_cartpole_gpu.py, its first iterations' losses and weights compiled against eager. Before:
    value loss 9.15 against 2.82, clip fraction 0 against 0.24 at the first iteration, and the policy never moved."""
    module = recipe_copy(os.path.join(ROOT, "ppo_cartpole_gpu.py"), str(in_tmp), LAYERNORM_DROPOUT, "layernorm_dropout")
    assert any(isinstance(layer, nn.LayerNorm) for layer in module.Agent(4, 2).actor)
    train_in_every_compiled_mode(module, in_tmp, dropout="Dropout")


@pytest.mark.parametrize("kinds", [list(LAYERS), DRAWS_NO_MASK], ids=["all", "all without dropout"])
def test_random_and_normalising_layers_at_once_train_as_eager_in_every_compiled_mode(kinds, in_tmp, monkeypatch):
    """The layers of `LAYERS` in one network, in both networks (the test below takes each alone, behind `slow`);
    without dropout, only the stacked seeds, which refuse dropout compiled (one run compiles all of them in `all`)."""
    import ppo_cartpole_gpu as module

    with_layers(module, monkeypatch, *kinds)
    dropout = "Dropout" if "dropout" in kinds[0] else None
    train_in_every_compiled_mode(module, in_tmp, dropout, one_run=kinds == list(LAYERS))


@pytest.mark.slow
@pytest.mark.parametrize("kind", LAYERS)
def test_each_random_or_normalising_layer_trains_as_eager_in_every_compiled_mode(kind, in_tmp, monkeypatch):
    import ppo_cartpole_gpu as module

    with_layers(module, monkeypatch, kind)
    dropouts = [type(m).__name__ for m in module.Agent(4, 2).modules() if type(m).__name__.endswith("Dropout")]
    train_in_every_compiled_mode(module, in_tmp, dropouts[0] if dropouts else None)


@pytest.mark.learning
@pytest.mark.parametrize("seed", [1, 2])
def test_the_layernorm_dropout_copy_solves_cartpole_compiled(seed, in_tmp):
    """The issue's copy, compiled, at its defaults: solved within PPO's budget of test_learning.py, and its greedy
    policy too. Before: a last-100 mean of 9.4 after 120,000 steps (eager: 500)."""
    module = recipe_copy(os.path.join(ROOT, "ppo_cartpole_gpu.py"), str(in_tmp), LAYERNORM_DROPOUT, "layernorm_dropout")
    torch._dynamo.reset()
    module.train(module.Args(seed=seed, compile=True, device="cpu", progress_bar=False))
    (summary,) = [read_json(path) for path in glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))]
    assert summary["solved_at_step"] is not None and summary["solved_at_step"] <= BUDGET["ppo_cartpole_gpu"], summary
    assert summary["eval_mean_return"] >= 475, summary
