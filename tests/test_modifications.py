"""Copy it, change it: the changes users make in a copy of a CartPole script, made here in code, each checked in the
modes it meets: --compile against eager, stopped and resumed against one run straight through (docs/modifying.md).
Under `pytest --script COPY` the same changes are made to the copy."""

import glob
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch._dynamo
import torch.nn as nn

from conftest import (
    COPY,
    PATHS,
    ROOT,
    SCRIPTS,
    assert_close,
    assert_one_error_line,
    assert_same_agents,
    assert_same_scalars,
    call_main,
    import_script,
    learning_last,
    origin,
    read_json,
    retarget,
    run_dir,
    scalars,
    small_args,
    stop_with_sigterm_at,
    stopped_and_resumed,
    swap_adam,
    train_seeds,
)
from ladder.flags import UsageError
from ladder.optim import Adam
from recipes import RECURRENT, recipe_copy, recipe_diff, recurrent_copy

LOSS = {"ppo_cartpole_gpu": "ppo_loss", "vpg": "vpg_loss", "reinforce": "reinforce_loss"}
"""The name of each script's loss function."""


def three_ways(module, monkeypatch, tmp, envs=None, script: str = "", compile: bool = True):
    """The (changed) script trained for six iterations with --compile, eagerly, and stopped by SIGTERM after the third
    then resumed; returns the eager, compiled and resumed agents. `envs`: an env class to train on instead of the
    CartPole; `script`: the script the module was made from, when its name is not it (a recipe's copy). Compiled for
    PPO (and for a copy under --script) only, to spare CI's minutes: VPG
    and REINFORCE compile
    the same `compile_phases` and `gradient_step` (test_layout.py checks the copies match), and test_compile.py compiles
    their losses."""
    args = small_args(module, eval_episodes=0)
    make = lambda: None if envs is None else envs(args.num_envs, "cpu", args.seed)
    fast = None
    name = script or module.__name__
    if compile and (origin(name) == "ppo_cartpole_gpu" or name in COPY):
        torch._dynamo.reset()  # each change compiles afresh: no test meets another's graphs or recompilation limit
        fast = module.train(replace(args, exp_name="compiled", compile=True), make())
    eager, resumed, _ = stopped_and_resumed(module, args, tmp, monkeypatch, make)
    return eager, fast, resumed


def assert_same_training(eager, compiled, resumed) -> None:
    """Resumed: the same state bit for bit; compiled: within float tolerance (see test_compile.py)."""
    assert_same_agents(resumed, eager, "resumed", exact=True)
    if compiled is not None:
        assert_same_agents(compiled, eager, "compiled", atol=2e-4, rtol=1e-3)


# An edit to the gradient step -----------------------------------------------------------------
NO_STEP = [("    nn.utils.clip_grad_norm_(",
            "    for p in agent.parameters():\n"
            "        p.grad.mul_(0.0)  # the edit: no gradient, so no step\n"
            "    nn.utils.clip_grad_norm_(")]  # fmt: skip


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_an_edit_to_the_gradient_step_runs_in_every_mode(name, in_tmp, monkeypatch):
    """A copy whose `gradient_step` zeroes the gradient keeps its initial weights in every mode: eager, compiled, as
    two stacked seeds, replayed as a CUDA graph (on the CPU) and stopped and resumed. Before, --compile and
    --num-seeds ran a step of ladder's own in its place: the weights moved by 0.158 and 0.168."""
    from test_graph import replayed_on_the_cpu

    script = PATHS.get(name, os.path.join(ROOT, f"{origin(name)}.py"))
    module = recipe_copy(script, str(in_tmp), NO_STEP, "no_step")
    monkeypatch.setitem(COPY, module.__name__, origin(name))  # (small_args: the script's own sizes)
    start, initial = module.Run.start, []

    def recording(self, agent, *rest, **stateful):  # each seed's agent and its weights before training
        initial.append((agent, {k: v.clone() for k, v in agent.named_parameters()}))
        return start(self, agent, *rest, **stateful)

    monkeypatch.setattr(module.Run, "start", recording)
    args = small_args(module, eval_episodes=0)
    modes = {"eager": {}, "two stacked seeds": dict(num_seeds=2)}
    tiny = dict(num_steps=4, num_minibatches=1, update_epochs=1)  # (one graph with the rollout: a small one)
    compiled = {"compiled": dict(compile=True), "compiled stacked seeds": dict(compile=True, num_seeds=2, **tiny)}
    modes |= compiled if origin(name) == "ppo_cartpole_gpu" else {}  # (the others: the same step)
    for mode, flags in modes.items():
        torch._dynamo.reset()
        module.train(replace(args, exp_name=mode.replace(" ", "_"), **flags))
    with pytest.MonkeyPatch.context() as patch:
        replayed_on_the_cpu(module, patch)
        module.train(replace(args, exp_name="replayed"))
        stop_with_sigterm_at(module, patch, 3)
        with pytest.raises(KeyboardInterrupt):
            module.train(replace(args, exp_name="cut"))
    module.train(replace(args, resume=run_dir(in_tmp, "cut"), total_timesteps=2 * args.total_timesteps))
    assert len(initial) == len(modes) + sum(flags.get("num_seeds", 1) - 1 for flags in modes.values()) + 3
    for i, (agent, weights) in enumerate(initial):
        moved = {k: float((v - weights[k]).abs().max()) for k, v in agent.named_parameters()}
        assert not any(moved.values()), f"run {i} of {len(initial)}: the weights moved by {moved}"


# A shared module ------------------------------------------------------------------------------
def shared_trunk(module):
    """The script's Agent with a module in two places: the actor's first layer is the critic's (REINFORCE, which has
    no critic: its actor's hidden layer applied twice)."""

    class SharedTrunk(module.Agent):
        def __init__(self, *args):
            super().__init__(*args)
            if hasattr(self, "critic"):
                self.actor[0] = self.critic[0]
            else:
                self.actor = nn.Sequential(*self.actor[:4], *self.actor[2:])

    return SharedTrunk


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_shared_module_trains_compiled_resumed_and_stacked(name, in_tmp, monkeypatch):
    """A module in two places (the actor's first layer the critic's): ladder's Adam takes it once, and eager,
    compiled, stopped and resumed, and as two stacked seeds it trains as one run; two stacked seeds compiled train as
    eager ones. (torch 2.13 cannot compile torch.func.grad over a functional_call of such a module that ties its
    weights, test_compile.py; ladder's functional_calls give each place its tensor, tie_weights=False, which compiles:
    with the default the compiled stacked call failed, "Non-constant GetAttrVariable hash".)"""
    from test_many_seeds import stacked_stopped_and_resumed

    module = import_script(name)
    monkeypatch.setattr(module, "Agent", shared_trunk(module))
    with pytest.MonkeyPatch.context() as patch:  # (its SIGTERM undone after)
        eager, compiled, resumed = three_ways(module, patch, in_tmp)
    assert len(list(eager.named_parameters(remove_duplicate=False))) > len(list(eager.parameters()))
    assert_same_training(eager, compiled, resumed)
    if origin(name) == "ppo_cartpole_gpu":
        (in_tmp / "stacked").mkdir()
        monkeypatch.chdir(in_tmp / "stacked")
        tiny = small_args(module, num_seeds=2, eval_episodes=0, num_steps=4, num_minibatches=1, update_epochs=1)
        eager = train_seeds(module, replace(tiny, exp_name="eager"))
        torch._dynamo.reset()
        compiled = train_seeds(module, replace(tiny, exp_name="compiled", compile=True))
        for k in range(2):
            assert_same_agents(compiled[k], eager[k], "compiled", atol=2e-4, rtol=1e-3)
        stacked_stopped_and_resumed(module, small_args(module, num_seeds=2, eval_episodes=0), in_tmp / "stacked",
                                    monkeypatch)  # fmt: skip


# Another optimizer ----------------------------------------------------------------------------
def decay_in_two_groups(module, monkeypatch, weight_decay: float = 1e-2) -> None:
    """train()'s `Adam(agent, lr=..., ...)` with two param groups: weight decay (AdamW's) on the weight matrices, none
    on the biases."""

    def make(agent, lr, **kwargs):
        params = list(agent.parameters())
        groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]  # fmt: skip
        return Adam(agent, groups, lr=lr, **kwargs)

    swap_adam(module, monkeypatch, make)


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_weight_decay_in_two_param_groups_trains_alike_compiled_and_resumed(name, in_tmp, monkeypatch):
    """Each param group's settings (here AdamW's weight decay on the matrices alone) in every mode alike: the same
    written-out step runs eager and compiled (before, --compile refused any optimizer but plain Adam, then swapped
    the script's step for one of its own)."""
    module = import_script(name)
    decay_in_two_groups(module, monkeypatch)
    assert_same_training(*three_ways(module, monkeypatch, in_tmp))


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_optimizer_settings_a_checkpoint_replaces_are_noted(name, in_tmp, monkeypatch, capsys):
    """The code's weight decay changed between the stop and --resume: the checkpoint's (its optimizer's state_dict)
    wins, as torch's load_state_dict has it, and a note says so. Before, silently."""
    module = import_script(name)
    decay_in_two_groups(module, monkeypatch, weight_decay=1e-2)
    args = small_args(module, eval_episodes=0)
    stop_with_sigterm_at(module, monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        module.train(args)
    decay_in_two_groups(module, monkeypatch, weight_decay=1e-3)
    capsys.readouterr()
    module.train(replace(args, resume=run_dir(in_tmp, args.exp_name)))
    err = capsys.readouterr().err
    assert "note: the checkpoint's optimizer weight_decay 0.01 replaces the code's 0.001" in err, err
    assert err.count("replaces the code's") == 1  # the biases' group kept its 0.0


def two_adam_optimizers(module, monkeypatch) -> dict:
    """train()'s Adam made two: one for the actor (the one train() goes on with and gives `run.start`), one for the
    critic at its own rate, given to `run.start` as `second` and stepped after the first by `gradient_step`, on its
    own gradient (a copy's actor and critic optimizers). Returns {"second": the second optimizer}."""
    real_start, real_step, box = module.Run.start, module.gradient_step, {}
    critic = "critic" if module.__name__ != "reinforce" else "actor.4"  # (REINFORCE: its output layer)

    def make(agent, **kwargs):
        box["second"] = Adam(agent, agent.get_submodule(critic).parameters(), **kwargs | {"lr": 1e-3})
        return Adam(agent, **kwargs)  # the trainable parameters left: the actor's

    def gradient_step(agent, optimizer, loss_fn, args, batch, idx=None):
        stats = real_step(agent, optimizer, loss_fn, args, batch, idx)
        minibatch = batch if idx is None else type(batch)(*(x[idx] for x in batch))
        box["second"].zero_grad()
        box["second"].backward(loss_fn, agent, args, minibatch)
        box["second"].step()
        return stats

    swap_adam(module, monkeypatch, make)
    monkeypatch.setattr(module, "gradient_step", gradient_step)
    monkeypatch.setattr(module.Run, "start", lambda self, *a, **k: real_start(self, *a, **k, second=box["second"]))
    return box


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_two_optimizers_train_alike_compiled_resumed_and_stacked(name, in_tmp, monkeypatch):
    """Two Adam optimizers, each for part of the agent, each stepped on its own gradient by the copy's
    `gradient_step`: the same weights eager and compiled, resumed as one run, and (PPO) as two stacked seeds. Before,
    the one-graph step stepped every parameter with the first optimizer's settings and crashed writing its final
    checkpoint (`KeyError: 140039397471600`), and --num-seeds refused two optimizers."""
    from test_many_seeds import stacked_stopped_and_resumed

    module = import_script(name)
    box = two_adam_optimizers(module, monkeypatch)
    with pytest.MonkeyPatch.context() as patch:  # (its SIGTERM undone after)
        assert_same_training(*three_ways(module, patch, in_tmp))
    assert float(box["second"].state["flat"]["step"]) > 0
    if origin(name) == "ppo_cartpole_gpu":
        (in_tmp / "stacked").mkdir()
        monkeypatch.chdir(in_tmp / "stacked")
        args = small_args(module, num_seeds=2, eval_episodes=0)
        stacked_stopped_and_resumed(module, args, in_tmp / "stacked", monkeypatch)


# docs/modifying.md's recipe, as tests/recipes.py writes it (test_cleanrl.py checks the two alike)
class SGD(Adam):
    """SGD with momentum on ladder's flat vector: Adam's parameters, backward and state (the velocity: exp_avg)."""

    def step(self, closure=None):
        grad, velocity = self.flat_grad(), self.state["flat"]["exp_avg"]
        for group, p, g, v in zip(self.param_groups, *(x.split(self.sizes) for x in (self.flat, grad, velocity))):
            v.mul_(0.9).add_(g)
            p.sub_(group["lr"] * v)


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_another_optimizer_trains_alike_compiled_and_resumed(name, in_tmp, monkeypatch):
    """SGD with momentum in place of Adam (docs/modifying.md's recipe: a subclass of ladder's Adam with its step
    written out): eager and compiled alike, resumed as one run (its velocity in the checkpoint)."""
    module = import_script(name)
    swap_adam(module, monkeypatch, lambda agent, lr, eps: SGD(agent, lr=lr))
    eager, compiled, resumed = three_ways(module, monkeypatch, in_tmp)
    assert_same_training(eager, compiled, resumed)


def auxiliary_phase(module, monkeypatch, stacked: bool = True) -> dict:
    """A PPG-style auxiliary phase (Cobbe et al. 2021): the agent gets a head the loss does not use, with an Adam of
    its own (given to `run.start`), trained after every second iteration by two gradient steps on the rollout's
    observations (a value-like target); the policy's Adam holds the rest. --num-seeds K: the phase is wrapped by
    `run.one_call` (`stacked`, as docs/modifying.md says), or not. Returns {"aux_steps": how many it took}."""
    real_film, real_start, box, Agent = module.Run.film, module.Run.start, {"aux_steps": 0}, module.Agent

    class WithAuxHead(Agent):
        def __init__(self, obs_dim, *args):
            super().__init__(obs_dim, *args)
            with torch.random.fork_rng():  # the global stream (the actions' noise) as the script's own
                self.aux_head = nn.Linear(obs_dim, 1)

    def make(agent, **kwargs):
        box["aux"] = Adam(agent, agent.aux_head.parameters(), **kwargs)
        return Adam(agent, **kwargs)  # the trainable parameters left: all but the head's

    def aux_loss(agent, obs):
        return (agent.aux_head(obs).squeeze(-1) - obs[:, 0]).square().mean(), {}

    def aux_phase(agent, rollout):  # returns nothing: the stacked call returns {} for it
        for _ in range(2):
            box["aux"].zero_grad()
            box["aux"].backward(aux_loss, agent, rollout.obs[0])  # the first step's (REINFORCE's later ones: stale)
            box["aux"].step()

    def film(self, rollout=None):  # (called after run.log in every iteration, with the rollout)
        if box.get("run") is not self:  # made once in each run, as train() would before its loop
            box["run"], box["phase"] = self, self.one_call(aux_phase) if stacked and self.k > 1 else aux_phase
        if self.progress.iteration % 2 == 0:  # every second iteration
            box["phase"](self.agent, rollout)
            box["aux_steps"] += 2
        return real_film(self, rollout)

    monkeypatch.setattr(module, "Agent", WithAuxHead)
    swap_adam(module, monkeypatch, make)
    monkeypatch.setattr(module.Run, "start", lambda self, *a, **k: real_start(self, *a, **k, aux=box["aux"]))
    monkeypatch.setattr(module.Run, "film", film)
    return box


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_an_auxiliary_phase_trains_alike_compiled_and_resumed(name, in_tmp, monkeypatch):
    """The auxiliary phase's head with an Adam of its own: the policy's steps leave it alone (its step count that of
    the auxiliary steps), the same weights eager and compiled, resumed as one run. Before, the compiled step moved it
    on its momentum at every minibatch (the issue's PPG copy: stepped 112 times instead of 32, its actor 0.083 from
    eager after 5 iterations)."""
    module = import_script(name)
    box = auxiliary_phase(module, monkeypatch)
    eager, compiled, resumed = three_ways(module, monkeypatch, in_tmp)
    assert_same_training(eager, compiled, resumed)
    iterations = read_json(os.path.join(run_dir(in_tmp, "whole"), "summary.json"))["iterations"]
    assert float(box["aux"].state["flat"]["step"]) == 2 * (iterations // 2)  # the resumed run's: its own


# Resume that cannot go stale ------------------------------------------------------------------
@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_param_groups_taken_before_run_start_stay_live_after_a_resume(name, in_tmp, monkeypatch):
    """A copy that anneals its rate through the param groups it took before `run.start` (a list of them, here halving
    every rate each iteration): resumed, it goes on annealing. Before, `--resume` replaced the group dicts
    (torch's load_state_dict makes new ones), so the copy wrote to dicts nobody read: the rate stayed put for the
    rest of the run (the issue's copy: 0.003 for the last 60%, weights 0.071 off)."""
    module = import_script(name)
    real_start, real_log, box = module.Run.start, module.Run.log, {}

    def start(self, agent, envs, optimizer, *args, **kwargs):
        box["groups"] = list(optimizer.param_groups)  # taken before run.start
        return real_start(self, agent, envs, optimizer, *args, **kwargs)

    def log(self, *args, **kwargs):
        for group in box["groups"]:
            group["lr"] *= 0.5
        return real_log(self, *args, **kwargs)

    monkeypatch.setattr(module.Run, "start", start)
    monkeypatch.setattr(module.Run, "log", log)
    whole, resumed, _ = stopped_and_resumed(module, small_args(module, eval_episodes=0, anneal_lr=False), in_tmp,
                                            monkeypatch)  # fmt: skip
    assert_same_scalars(run_dir(in_tmp, "cut"), run_dir(in_tmp, "whole"))
    assert_same_training(whole, None, resumed)


def lr_scheduler(module, monkeypatch, given: bool = True, step_size: int = 2) -> dict:
    """A torch.optim.lr_scheduler (StepLR: the rate halved every `step_size` iterations) on train()'s optimizer, stepped
    after `run.log` in the loop body and, with `given`, given to `run.start`. Returns {"scheduler": it}."""
    real_start, real_log, box = module.Run.start, module.Run.log, {}

    def make(agent, **kwargs):  # each optimizer's own (--num-seeds: each seed's, the last the one train() steps)
        optimizer = Adam(agent, **kwargs)
        box["scheduler"] = box[optimizer] = torch.optim.lr_scheduler.StepLR(optimizer, step_size, gamma=0.5)
        return optimizer

    def start(self, agent, envs, optimizer, *args, **kwargs):
        self.scheduler = box[optimizer]
        return real_start(
            self, agent, envs, optimizer, *args, **kwargs, **({"scheduler": box[optimizer]} if given else {})
        )

    def log(self, *args, **kwargs):  # `if run.log(...): break`, then `scheduler.step()` in the loop body
        reached = real_log(self, *args, **kwargs)
        self.scheduler.step()
        return reached

    swap_adam(module, monkeypatch, make)
    monkeypatch.setattr(module.Run, "start", start)
    monkeypatch.setattr(module.Run, "log", log)
    return box


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_scheduler_stepped_after_run_log_resumes_in_step(name, in_tmp, monkeypatch):
    """The checkpoint is written at the end of the iteration, after the whole loop body: a scheduler stepped after
    `run.log` is in it, and the resumed run's rates are one run's. Before, the checkpoint was written inside
    `run.log`, and a signal stopped the run there: the resumed schedule lagged one step for the rest of the run (the
    issue's copy: weights 0.018 off), which `pytest --script` reported without saying why."""
    module = import_script(name)
    lr_scheduler(module, monkeypatch)
    whole, resumed, _ = stopped_and_resumed(module, small_args(module, eval_episodes=0, anneal_lr=False), in_tmp,
                                            monkeypatch)  # fmt: skip
    assert_same_scalars(run_dir(in_tmp, "cut"), run_dir(in_tmp, "whole"))
    assert_same_training(whole, None, resumed)


@pytest.mark.behaviour
@pytest.mark.parametrize("name", retarget(["ppo_cartpole_gpu"]))
def test_a_scheduler_steps_two_stacked_seeds_and_resumes_them_exactly(name, in_tmp, monkeypatch, recwarn):
    """--num-seeds 2: the scheduler train() steps (the one given to its run.start) sets every seed's rate; each
    seed's checkpoint holds it, and the two resumed train as the two straight through (rates, scalars, weights). The
    rate changes at every iteration: before, each seed's checkpoint held the rate of the iteration before the
    scheduler's last step (copied into the seeds when logged), and the resumed seeds' weights ended 0.15 apart. No
    warning that the scheduler steps before the optimizer."""
    from test_many_seeds import stacked_stopped_and_resumed

    module = import_script(name)
    lr_scheduler(module, monkeypatch, step_size=1)
    args = small_args(module, num_seeds=2, eval_episodes=0, anneal_lr=False)
    stacked_stopped_and_resumed(module, args, in_tmp, monkeypatch)  # the same scalars (the rates too) and weights
    rates = [rate for _, rate in scalars(glob.glob(str(in_tmp / "runs" / "*__whole__2__*"))[0])["charts/learning_rate"]]
    assert rates[0] == pytest.approx(args.learning_rate) and rates[-1] < rates[0] / 2, rates
    # the written-out step (as --compile's) takes the optimizer's steps: before, torch warned that none was taken
    assert not [w for w in recwarn if "before `optimizer.step()`" in str(w.message)]


@pytest.mark.behaviour
@pytest.mark.parametrize("name", retarget(["ppo_cartpole_gpu"]))
def test_a_scheduler_trains_alike_compiled(name, in_tmp, monkeypatch, recwarn):
    """--compile with a scheduler, as the recipe says: torch's scheduler wraps optimizer.step in a function dynamo
    skips, and the compiled gradient step stopped there (`error: --compile: Attempted to call function marked as
    skipped`, found by a user's trial of the recipe); ladder's Adam is marked as wrapped already, so the compiled run
    trains as the eager one, its rates the schedule's, a compiled run stopped and resumed equals one compiled run,
    and the scheduler warns of nothing."""
    module = import_script(name)
    lr_scheduler(module, monkeypatch, step_size=1)
    args = small_args(module, eval_episodes=0, anneal_lr=False)
    eager = module.train(replace(args, exp_name="eager"))
    torch._dynamo.reset()
    compiled, resumed, _ = stopped_and_resumed(module, replace(args, compile=True), in_tmp, monkeypatch)
    assert_same_agents(compiled, eager, "compiled", atol=2e-4, rtol=1e-3)
    assert_same_agents(resumed, compiled, "resumed", exact=True)
    assert_same_scalars(run_dir(in_tmp, "cut"), run_dir(in_tmp, "whole"))
    rates = [rate for _, rate in scalars(run_dir(in_tmp, "whole"))["charts/learning_rate"]]
    assert rates[0] == pytest.approx(args.learning_rate), rates
    assert rates[-1] == pytest.approx(rates[0] / 2 ** (len(rates) - 1)), rates
    assert not [w for w in recwarn if "optimizer.step()" in str(w.message)]


def test_a_scheduler_not_given_to_run_start_is_refused_in_one_line(in_tmp, monkeypatch):
    """A scheduler on the run's optimizer that `run.start` was not given would start its schedule over at a resume
    (the issue's copy: its rate climbed to 4.7x the configured peak): refused at start, in one line."""
    lr_scheduler(import_script("ppo_cartpole_gpu"), monkeypatch, given=False)
    result = call_main("ppo_cartpole_gpu", *short_flags("ppo_cartpole_gpu"), "--no-anneal-lr", cwd=in_tmp)
    assert_one_error_line(result, "a torch.optim.lr_scheduler drives the optimizer: give it to run.start(..., "
                                  "scheduler=scheduler), or a --resume would start its schedule over")  # fmt: skip


def test_a_scheduler_with_anneal_lr_is_refused_in_one_line(in_tmp, monkeypatch):
    """The default --anneal-lr sets the rate at every iteration, over a scheduler's: refused at start, in one line.
    Before, a LambdaLR warm-up had no effect at all, silently (its first iteration logged the full rate)."""
    lr_scheduler(import_script("ppo_cartpole_gpu"), monkeypatch)
    result = call_main("ppo_cartpole_gpu", *short_flags("ppo_cartpole_gpu"), cwd=in_tmp)
    assert_one_error_line(result, "a torch.optim.lr_scheduler and --anneal-lr both set the rate: pass --no-anneal-lr")


# Another env ----------------------------------------------------------------------------------
class Pendulum:
    """A pole on a motor, discrete torque (-1, 0, +1), with CartPole's interface: the state (angle, speed) is not the
    observation (cos, sin, speed / 8), so a resume must return the env's observation, not its state. Rewarded
    cos(angle) (upright: 1); an episode fails when the pole spins faster than 8 rad/s, and is cut at 50 steps."""

    obs_dim, num_actions, max_episode_steps, reward_threshold = 3, 3, 50, None

    def __init__(self, num_envs: int, device="cpu", seed: int = 0):
        self.num_envs, self.device = num_envs, torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.state = self.draw_initial_states(num_envs)
        self.episode_return = torch.zeros(num_envs, device=self.device)
        self.episode_length = torch.zeros(num_envs, dtype=torch.int32, device=self.device)

    def draw_initial_states(self, *shape: int) -> torch.Tensor:
        """(*shape, 2): angles uniform in [-π, π), speeds in [-1, 1)."""
        u = torch.rand(*shape, 2, device=self.device, generator=self.generator) * 2 - 1
        return u * torch.tensor([math.pi, 1.0], device=self.device)

    def observe(self, state: torch.Tensor) -> torch.Tensor:
        angle, speed = state.unbind(-1)
        return torch.stack((angle.cos(), angle.sin(), speed / 8), -1)

    def reset(self):
        self.state = self.draw_initial_states(self.num_envs)
        self.episode_return, self.episode_length = self.episode_return * 0, self.episode_length * 0
        return self.observe(self.state), {}

    def move(self, action: torch.Tensor):
        """One step of the pole: the new `self.state`, and (reward, terminated)."""
        angle, speed = self.state.unbind(-1)
        speed = speed + 0.05 * (4.0 * (action - 1) - 9.8 * angle.sin())
        self.state = torch.stack((angle + 0.05 * speed, speed), -1)
        return self.state[:, 0].cos(), speed.abs() > 8

    def step(self, action: torch.Tensor, initial_states=None):
        reward, terminated = self.move(action)
        self.episode_return, self.episode_length = self.episode_return + reward, self.episode_length + 1
        truncated = self.episode_length >= self.max_episode_steps
        info = {"final_obs": self.observe(self.state), "episode_return": self.episode_return,
                "episode_length": self.episode_length}  # fmt: skip
        done = terminated | truncated
        fresh = self.draw_initial_states(self.num_envs) if initial_states is None else initial_states
        self.state = torch.where(done.unsqueeze(-1), fresh, self.state)
        self.episode_return = self.episode_return.masked_fill(done, 0.0)
        self.episode_length = self.episode_length.masked_fill(done, 0)
        return self.observe(self.state), reward, terminated, truncated, info

    def state_dict(self) -> dict:
        return {"state": self.state, "episode_return": self.episode_return, "episode_length": self.episode_length,
                "generator": self.generator.get_state()}  # fmt: skip

    def load_state_dict(self, saved: dict) -> torch.Tensor:
        keys = ("state", "episode_return", "episode_length")
        self.state, self.episode_return, self.episode_length = (saved[key] for key in keys)
        self.generator.set_state(saved["generator"])
        return self.observe(self.state)


# Continuous actions ---------------------------------------------------------------------------
class ContinuousPendulum(Pendulum):
    """Gymnasium's Pendulum-v1 in tensors: a torque in [-2, 2] swings a pole up; reward -(θ² + 0.1 θ'² + 0.001 u²),
    θ wrapped to [-π, π); never terminates. Cut at 50 steps (gymnasium: 200), which keeps REINFORCE's test runs at six
    iterations. `num_actions` is the action's dimension."""

    obs_dim, num_actions, max_episode_steps = 3, 1, 50
    max_speed, max_torque, dt, g = 8.0, 2.0, 0.05, 10.0  # mass and length 1

    def observe(self, state: torch.Tensor) -> torch.Tensor:
        angle, speed = state.unbind(-1)
        return torch.stack((angle.cos(), angle.sin(), speed), -1)

    def move(self, action: torch.Tensor):
        angle, speed = self.state.unbind(-1)
        torque = action.squeeze(-1).clamp(-self.max_torque, self.max_torque)
        upright = (angle + math.pi) % (2 * math.pi) - math.pi
        reward = -(upright.square() + 0.1 * speed.square() + 0.001 * torque.square())
        speed = (speed + (1.5 * self.g * angle.sin() + 3.0 * torque) * self.dt).clamp(-self.max_speed, self.max_speed)
        self.state = torch.stack((angle + speed * self.dt, speed), -1)
        return reward, torch.zeros_like(reward, dtype=torch.bool)


def gaussian_actions(module, monkeypatch):
    """docs/modifying.md's continuous-actions recipe made in code: the script's Agent with its actor as the mean of a
    diagonal Gaussian and a state-independent log std (CleanRL's ppo_continuous_action), standard normal noise drawn
    before the rollout in place of the Gumbel noise, and float actions of the env's dimension in the rollout."""
    Agent, Rollout, RolloutNoise = module.Agent, module.Rollout, module.RolloutNoise
    real_empty = Rollout.empty

    class GaussianAgent(Agent):
        def __init__(self, obs_dim, action_dim):
            super().__init__(obs_dim, action_dim)  # the actor (its head at std 0.01) is the mean
            self.actor_logstd = nn.Parameter(torch.zeros(action_dim))

        def get_action(self, obs, noise=None):  # mean + σ ε, ε ~ N(0, 1); without noise: the mean
            mean = self.actor(obs)
            return mean if noise is None else mean + self.actor_logstd.exp() * noise

        def forward(self, obs, action):  # log N(a; μ, σ²) and the entropy, summed over the action's dimensions
            mean = self.actor(obs)
            logstd = self.actor_logstd.expand_as(mean)
            logp = -0.5 * ((action - mean) / logstd.exp()).square() - logstd - 0.5 * math.log(2 * math.pi)
            entropy = (logstd + 0.5 + 0.5 * math.log(2 * math.pi)).sum(-1)
            return logp.sum(-1), entropy, *((self.get_value(obs),) if hasattr(self, "critic") else ())

    def draw(envs, num_steps):
        normal = torch.randn(num_steps, envs.num_envs, envs.num_actions, device=envs.device)
        return RolloutNoise(normal, envs.draw_initial_states(num_steps, envs.num_envs))

    def empty(num_steps, num_envs, obs_dim, device):
        actions = torch.zeros(num_steps, num_envs, ContinuousPendulum.num_actions, device=device)
        return real_empty(num_steps, num_envs, obs_dim, device)._replace(actions=actions)

    monkeypatch.setattr(module, "Agent", GaussianAgent)
    monkeypatch.setattr(RolloutNoise, "draw", staticmethod(draw))
    monkeypatch.setattr(Rollout, "empty", staticmethod(empty))


def test_the_continuous_pendulum_moves_as_gymnasiums():
    """ContinuousPendulum against gymnasium's Pendulum-v1, an episode of random torques (beyond ±2 too) from the same
    state: the same observations and rewards within float32's tolerance, and cut at its last step."""
    from gymnasium.envs.classic_control.pendulum import PendulumEnv

    reference, envs = PendulumEnv(), ContinuousPendulum(1, seed=3)
    reference.reset(seed=0)
    reference.state = envs.state[0].double().numpy().copy()
    torques = torch.rand(envs.max_episode_steps, 1, 1, generator=torch.Generator().manual_seed(1)) * 6 - 3
    for step, torque in enumerate(torques, 1):
        expected_obs, expected_reward, *_ = reference.step(torque[0].double().numpy())
        obs, reward, terminated, truncated, info = envs.step(torque)
        obs = info["final_obs"]  # (at the cut, `obs` is a fresh episode's)
        assert_close(obs[0], torch.tensor(expected_obs, dtype=torch.float32), "obs", atol=1e-4, rtol=1e-4)
        assert_close(reward[0], torch.tensor(expected_reward, dtype=torch.float32), "reward", atol=1e-4, rtol=1e-4)
        assert not terminated.any() and truncated.tolist() == [step == envs.max_episode_steps]


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_continuous_actions_train_alike_compiled_and_resumed(name, in_tmp, monkeypatch):
    """A Gaussian policy on the continuous Pendulum (the recipe): --compile within float tolerance of eager, stopped
    and resumed as one run. Before, its compiled rollout took minutes (inductor's CPU bound of 50 ops inlined the
    pendulum's recurrence step after step: 435 s at 12 steps); ladder.compile sets it to the GPU's 30."""
    module = import_script(name)
    gaussian_actions(module, monkeypatch)
    eager, compiled, resumed = three_ways(module, monkeypatch, in_tmp, envs=ContinuousPendulum)
    assert eager.actor_logstd.shape == (1,) and not torch.equal(eager.actor_logstd, torch.zeros(1))
    assert_same_training(eager, compiled, resumed)


# A recurrent policy ---------------------------------------------------------------------------
def recurrent(name: str, folder):
    """The copy of script `name` with the recurrent recipe made (tests/recipes.py); skipped for a copy under --script
    whose lines the recipe does not find."""
    script_file = PATHS.get(name, os.path.join(ROOT, name + ".py"))
    try:
        return recurrent_copy(script_file, str(folder))
    except AssertionError as e:
        if name in COPY:
            pytest.skip(str(e))
        raise


@pytest.mark.behaviour
@pytest.mark.parametrize("name", [name for name in SCRIPTS if origin(name) != "reinforce"])
def test_a_recurrent_policy_trains_alike_compiled_resumed_and_stacked(name, in_tmp, monkeypatch):
    """The recipe's GRU policy on the CartPole without velocities, its hidden state a module given to `run.start` as
    `PerRank`: --compile within float tolerance of eager (PPO's, as `three_ways` says), stopped and resumed as one
    run (the hidden state in the checkpoint), two stacked seeds (each one's memory its own in the stacked call)
    stopped and resumed as the two straight through, and the greedy evaluation carrying its own hidden state.
    Before, a module given to `run.start` was not stacked: the stacked call wrote into seed 1's memory and stopped."""
    from test_many_seeds import stacked_stopped_and_resumed

    module = recurrent(name, in_tmp)
    envs = lambda num_envs, device, seed: module.PositionsCart(num_envs, device, seed)
    with pytest.MonkeyPatch.context() as patch:  # (its SIGTERM undone after)
        eager, compiled, resumed = three_ways(module, patch, in_tmp, envs=envs, script=name)
    assert isinstance(eager.actor[0], module.Recall) and eager.actor[0].gru.input_size == 2
    assert_same_training(eager, compiled, resumed)
    (in_tmp / "stacked").mkdir()
    monkeypatch.chdir(in_tmp / "stacked")
    args = small_args(module, num_seeds=2, eval_episodes=0)
    stacked, _, _ = stacked_stopped_and_resumed(module, args, in_tmp / "stacked", monkeypatch)
    assert not torch.equal(stacked[0].actor[0].gru.weight_hh, stacked[1].actor[0].gru.weight_hh)
    module.train(small_args(module, eval_episodes=2, total_timesteps=16 * 32, exp_name="evaluated"))
    summary = read_json(os.path.join(run_dir(in_tmp / "stacked", "evaluated"), "summary.json"))
    assert len(summary["eval_returns"]) == 2


@pytest.mark.quick
def test_the_docs_show_the_recurrent_recipe_as_the_test_makes_it():
    """docs/modifying.md's diff of the recurrent recipe is the one tests/recipes.py makes to ppo_cartpole_gpu.py, so
    the recipe a reader copies is the one tested in every mode."""
    with open(os.path.join(ROOT, "docs", "modifying.md")) as f:
        docs = f.read()
    shown = docs.split("```diff\n", 1)[1].split("\n```", 1)[0]
    assert shown == recipe_diff(os.path.join(ROOT, "ppo_cartpole_gpu.py"), RECURRENT)


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_an_env_with_its_own_state_trains_alike_compiled_and_resumed(name, in_tmp, monkeypatch):
    """Before, only a CartPole's state was checkpointed: a resumed run of another env restarted its episodes, and
    the weights differed from one run's, without a word. Now the env saves itself (state_dict / load_state_dict)."""
    module = import_script(name)
    eager, compiled, resumed = three_ways(module, monkeypatch, in_tmp, envs=Pendulum)
    assert eager.actor[0].in_features == Pendulum.obs_dim
    assert_same_training(eager, compiled, resumed)


@pytest.mark.behaviour
@pytest.mark.parametrize("name", retarget(["ppo_cartpole_gpu"]))
def test_an_env_with_its_own_state_resumes_compiled_as_one_compiled_run(name, in_tmp, monkeypatch):
    """The modes combined: the pendulum (its observation computed from its state, and again at resume), compiled,
    stopped and resumed, equals one compiled run bit for bit. (A user's Acrobot copy, its observation computed again
    eagerly at resume, ended 3e-8 off the compiled run: docs/modifying.md says to keep the last observation.)"""
    module = import_script(name)
    torch._dynamo.reset()
    args = small_args(module, eval_episodes=0, compile=True)
    stopped_and_resumed(module, args, in_tmp, monkeypatch, lambda: Pendulum(args.num_envs, "cpu", args.seed))


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_an_env_that_cannot_save_its_state_is_noted_at_resume(name, in_tmp, monkeypatch, capsys):
    """An env without state_dict() (as EnvPool's emulators): the resumed run starts new episodes, and says so."""
    module = import_script(name)
    forgetful = type("Forgetful", (), {k: v for k, v in vars(Pendulum).items() if "state_dict" not in k})
    args = small_args(module, eval_episodes=0)
    stop_with_sigterm_at(module, monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        module.train(args, forgetful(args.num_envs, "cpu", args.seed))
    capsys.readouterr()
    module.train(replace(args, resume=run_dir(in_tmp, args.exp_name)), forgetful(args.num_envs, "cpu", args.seed))
    assert "the envs have no state_dict(), so their episodes start anew" in capsys.readouterr().err


# A metric -------------------------------------------------------------------------------------
@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_statistic_may_be_nan_only_the_losses_must_be_finite(name, in_tmp, monkeypatch):
    """A statistic train() adds to `stats` reaches TensorBoard under its tag; NaN means "no value this iteration" (a
    ratio over the episodes that ended, when none did). Before, any NaN stopped the run as a "non-finite loss"."""
    module = import_script(name)
    real_log = module.Run.log

    def log(self, env_steps, stats, *episodes_rollout):  # as train() adding to `stats` before it calls run.log
        even = self.progress.iteration % 2 == 1  # the iteration being logged is the one after the counter's
        mine = {"charts/mine": torch.tensor(math.nan if even else 7.0)}
        return real_log(self, env_steps, stats | mine, *episodes_rollout)

    monkeypatch.setattr(module.Run, "log", log)
    module.train(small_args(module, eval_episodes=0))
    logged = scalars(run_dir(in_tmp, module.Args.exp_name))
    assert [value for _, value in logged["charts/mine"]] == [7.0] * 3
    assert [step for step, _ in logged["charts/mine"]] == [step for step, _ in logged["losses/entropy"]][::2]

    def nan_loss(self, env_steps, stats, *episodes_rollout):
        return real_log(self, env_steps, stats | {"losses/mine": torch.tensor(math.nan)}, *episodes_rollout)

    monkeypatch.setattr(module.Run, "log", nan_loss)
    with pytest.raises(FloatingPointError, match="non-finite loss at iteration 1"):
        module.train(small_args(module, eval_episodes=0))


@pytest.mark.parametrize("seeds", [1, 2])
def test_a_metric_with_a_gradient_or_a_python_number_is_logged(seeds, in_tmp, monkeypatch):
    """CleanRL logs what it likes: a weight's norm (a tensor that requires grad) and a Python float reach TensorBoard.
    Before, each ended in a traceback from inside run.log (`numpy()` on a tensor that requires grad; a float's
    `numel`), where the docs promise a tag of one's own (a user's trial). The norm is each seed's own by `run.each`,
    as docs/modifying.md#metrics writes it, in one run and in two stacked seeds; before, the docs' `x.flatten(1)`
    way ended one run in a traceback (another user's trial)."""
    module = import_script("ppo_cartpole_gpu")
    real_log = module.Run.log

    def log(self, env_steps, stats, *episodes_rollout):  # as train() adding to `stats` before it calls run.log
        mine = {"charts/norm": self.each(torch.linalg.vector_norm, self.agent.actor[0].weight)}
        mine |= {"charts/half": 0.5} if seeds == 1 else {}  # (K seeds: a number each)
        return real_log(self, env_steps, stats | mine, *episodes_rollout)

    monkeypatch.setattr(module.Run, "log", log)
    agent = module.train(small_args(module, eval_episodes=0, num_seeds=seeds))
    (folder,) = glob.glob(str(in_tmp / "runs" / f"*__{module.Args.exp_name}__{seeds}__*"))  # the last seed's
    logged = scalars(folder)
    assert seeds > 1 or [value for _, value in logged["charts/half"]] == [0.5] * 6
    norm = torch.linalg.vector_norm(agent.actor[0].weight).item()
    assert logged["charts/norm"][-1][1] == pytest.approx(norm, rel=0.1) and logged["charts/norm"][-1][1] > 0


# Extra state ----------------------------------------------------------------------------------
def adaptive_penalty(module, monkeypatch) -> dict:
    """A coefficient β (as in KL-penalty PPO, Schulman et al. 2017, sec. 4) that the loss uses and train() adapts
    after each iteration, in place, given to `run.start(..., beta=beta)` to be checkpointed; returns {"beta": β}."""
    loss_name, real_start, real_log, box = LOSS[origin(module.__name__)], module.Run.start, module.Run.log, {}
    real_loss = getattr(module, loss_name)

    def loss_fn(agent, args, batch):
        loss, stats = real_loss(agent, args, batch)
        return loss + 1e-3 * box["beta"] * sum(p.square().sum() for p in agent.parameters()), stats

    def start(self, *args, **kwargs):
        box["beta"] = torch.tensor(1.0, device=next(args[0].parameters()).device)  # with the agent: on its device
        return real_start(self, *args, **kwargs, beta=box["beta"])

    def log(self, *args, **kwargs):
        box["beta"].mul_(1.5)
        return real_log(self, *args, **kwargs)

    monkeypatch.setattr(module, loss_name, loss_fn)
    monkeypatch.setattr(module.Run, "start", start)
    monkeypatch.setattr(module.Run, "log", log)
    return box


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_state_given_to_run_start_is_kept_across_a_resume(name, in_tmp, monkeypatch):
    """Given by name to run.start, a tensor is checkpointed and restored in place. Before, only objects with a
    state_dict() could be given (a tensor crashed the first checkpoint), and what was not given restarted silently."""
    module = import_script(name)
    box = adaptive_penalty(module, monkeypatch)
    eager, compiled, resumed = three_ways(module, monkeypatch, in_tmp)
    iterations = read_json(os.path.join(run_dir(in_tmp, "cut"), "summary.json"))["iterations"]
    assert box["beta"].item() == 1.5**iterations  # the resumed run's β went on from the checkpoint's 1.5 ** 3
    assert_same_training(eager, compiled, resumed)


def test_state_that_cannot_be_checkpointed_is_refused_at_start(in_tmp, monkeypatch):
    """A float has no state_dict() and cannot be restored in place: one line at start, not a crash at the first
    checkpoint."""
    module = import_script("ppo_cartpole_gpu")
    real_start = module.Run.start
    monkeypatch.setattr(module.Run, "start", lambda self, *args, **kwargs: real_start(self, *args, **kwargs, beta=1.0))
    with pytest.raises(UsageError, match=r"run.start\(beta=...\) must be a tensor or have a state_dict\(\)"):
        module.train(small_args(module))
    assert not os.path.exists("runs")


# The learning rate ----------------------------------------------------------------------------
@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_every_param_group_is_annealed_from_its_own_first_rate(name, in_tmp, monkeypatch):
    """Two param groups (the first layer at a tenth of the rate, say): both anneal, each from its own rate. Before,
    only the first group's rate was annealed (CleanRL's scripts have the same trap)."""
    module, made = import_script(name), []

    def two_groups(agent, lr, **kwargs):
        params = list(agent.parameters())
        made.append(Adam(agent, [{"params": params[:2], "lr": lr / 10}, {"params": params[2:]}], lr=lr, **kwargs))
        return made[-1]

    swap_adam(module, monkeypatch, two_groups)
    args = small_args(module, eval_episodes=0)
    if not getattr(args, "anneal_lr", False):
        pytest.skip("this copy does not anneal its learning rate (no --anneal-lr, or off by default)")
    module.train(args)
    first, rest = (float(group["lr"]) for group in made[0].param_groups)
    assert 0 < rest < args.learning_rate, f"the learning rate ended at {rest}, not annealed below {args.learning_rate}"
    assert first == pytest.approx(rest / 10, rel=1e-6), f"the first group's rate ended at {first}, not {rest / 10}"


# The tests, on a copy -------------------------------------------------------------------------
@pytest.mark.quick
def test_pytest_script_runs_the_learning_tests_last():
    """`--script` orders the behavioural tests with the learning ones (minutes each) last, the rest as collected."""

    class Item:
        def __init__(self, name, learning=False):
            self.name, self.learning = name, learning

        def get_closest_marker(self, marker):
            return marker == "learning" and self.learning or None

    items = [Item("solves", learning=True), Item("probe"), Item("learns", learning=True), Item("compiled")]
    assert [item.name for item in learning_last(items)] == ["probe", "compiled", "solves", "learns"]


def test_pytest_script_runs_the_behavioural_tests_on_a_copy(tmp_path):
    """`python -m pytest --script COPY` runs the behavioural tests of the script COPY came from, on COPY (here those
    named "probe 4"): a copy whose policy gradient has the wrong sign fails probe 4 (one observation, action 1
    rewarded: it learns action 0), the faithful copy passes it."""
    with open(os.path.join(ROOT, "ppo_cartpole_gpu.py")) as f:
        text = f.read()
    wrong = "torch.max(-advantages * ratio, -advantages * ratio.clamp("  # both terms flipped: with the first alone
    assert wrong in text  # the surrogate was max(A r, -A clip(r)), which learnt probe 4 anyway on an Intel Xeon
    copies = {
        "my_ppo": text,
        "my_broken_ppo": text.replace(wrong, "torch.max(advantages * ratio, advantages * ratio.clamp("),
    }
    outcomes = {}
    for name, content in copies.items():
        path = tmp_path / f"{name}.py"
        path.write_text(content)
        command = [sys.executable, "-m", "pytest", f"--script={path}", "-p", "no:cacheprovider", "-v"]
        command += ["-k", "probe and 4"]
        # the faithful copy as a user types it (the whole suite collected); the broken one's file alone: 4 s less
        command += ["tests/test_probes.py"] if name == "my_broken_ppo" else []
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert f"testing {path} as a copy of ppo_cartpole_gpu.py" in run.stdout, run.stdout
        outcomes.update(line.split()[:2] for line in run.stdout.splitlines() if line.startswith("tests/"))
    assert outcomes == {"tests/test_probes.py::test_probe[my_ppo-4]": "PASSED",
                        "tests/test_probes.py::test_probe[my_broken_ppo-4]": "FAILED"}  # fmt: skip


# Values that change in training ---------------------------------------------------------------
def short_flags(name: str) -> list[str]:
    """A run of a few iterations on the CPU, no evaluation (REINFORCE: rollouts until every episode has ended)."""
    total = "12000" if origin(name) == "reinforce" else "2048"
    return [
        "--num-envs",
        "32",
        "--total-timesteps",
        total,
        "--no-progress-bar",
        "--eval-episodes",
        "0",
        "--device",
        "cpu",
    ]


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_flag_changed_during_training_is_refused_in_one_line(name, in_tmp, monkeypatch):
    """`args.ent_coef = ...` in train() (to anneal it) stops at the first assignment with one line that points to the
    tensor pattern. Before, --compile recompiled at every iteration (291 SPS) and died at the ninth in a 74-line
    traceback, and --resume went on from the changed value while refusing the original flag."""
    module = import_script(name)
    real_log = module.Run.log

    def log(self, *args, **kwargs):  # as train() annealing a flag after each iteration
        self.args.ent_coef = 0.9 * self.args.ent_coef
        return real_log(self, *args, **kwargs)

    monkeypatch.setattr(module.Run, "log", log)
    result = call_main(name, *short_flags(name), cwd=in_tmp)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot assign to field 'ent_coef'") and "docs/modifying.md#" in last, last
    assert "(a value derived from them: a variable of yours; one that changes: a tensor, docs/modifying.md#" in last


def annealed_buffer(module, monkeypatch) -> None:
    """An entropy coefficient in a buffer of the agent, read by the loss and halved in place after each iteration."""
    real_loss, real_log = getattr(module, LOSS[origin(module.__name__)]), module.Run.log

    class Annealed(module.Agent):
        def __init__(self, *args):
            super().__init__(*args)
            self.register_buffer("ent_coef", torch.tensor(0.05))

    def loss_fn(agent, args, batch):
        loss, stats = real_loss(agent, args, batch)
        return loss - agent.ent_coef * agent(batch.obs, batch.actions)[1].mean(), stats

    def log(self, *args, **kwargs):
        self.agent.ent_coef.mul_(0.5)
        return real_log(self, *args, **kwargs)

    monkeypatch.setattr(module, "Agent", Annealed)
    monkeypatch.setattr(module, LOSS[origin(module.__name__)], loss_fn)
    monkeypatch.setattr(module.Run, "log", log)


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_coefficient_annealed_in_a_buffer_trains_alike_compiled_and_resumed(name, in_tmp, monkeypatch):
    """docs/modifying.md's pattern for a value that changes in training: an entropy coefficient in a buffer of the
    agent, halved in place after each iteration, read by the loss; eager, compiled and resumed train alike, and the
    resumed run's coefficient went on from the checkpoint's."""
    module = import_script(name)
    annealed_buffer(module, monkeypatch)
    eager, compiled, resumed = three_ways(module, monkeypatch, in_tmp)
    iterations = read_json(os.path.join(run_dir(in_tmp, "cut"), "summary.json"))["iterations"]
    assert torch.equal(resumed.ent_coef, eager.ent_coef) and torch.equal(
        eager.ent_coef, torch.tensor(0.05) * 0.5**iterations
    )
    assert_same_training(eager, compiled, resumed)


@pytest.mark.parametrize("change, cause", [
    ("print", "Failed to trace builtin operator (File"),  # a graph break: printing a tensor
    ("branch", "Data-dependent branching (File"),  # an `if` on a tensor's value
    ("item", "a branch on a tensor's value or a host read (.item()) cannot be compiled"),  # (dynamo: torch._check)
    ("schedule", "it compiles again at every call, as "),  # a Python number the loss reads, changed every iteration
])  # fmt: skip
def test_what_stops_compilation_ends_the_run_in_one_line(change, cause, in_tmp, monkeypatch):
    """A loss that --compile cannot make one graph of ends the run with one line naming the cause and the line of the
    copy, and the docs' section. Before: a multi-page torch._dynamo traceback (74 lines for the recompilations)."""
    module, schedule = import_script("ppo_cartpole_gpu"), {"ent_coef": 0.01}
    real_loss, real_log = module.ppo_loss, module.Run.log

    def loss_fn(agent, args, batch):
        loss, stats = real_loss(agent, args, batch)
        if change == "print":
            print(loss)
        if change == "branch" and batch.advantages.mean() > 0:
            loss = loss * 1.0
        if change == "item" and batch.advantages.mean().item() > 0:
            loss = loss * 1.0
        return loss - schedule["ent_coef"] * stats["losses/entropy"], stats

    def log(self, *args, **kwargs):  # the schedule: a float, not a tensor
        schedule["ent_coef"] *= 0.9
        return real_log(self, *args, **kwargs)

    monkeypatch.setattr(module, "ppo_loss", loss_fn)
    monkeypatch.setattr(module.Run, "log", log)
    torch._dynamo.reset()
    seeds = ["--num-seeds", "2", "--num-steps", "4", "--num-minibatches", "1", "--update-epochs", "1"]
    seeds = seeds if change == "schedule" else []  # one seed takes the number as an input (test_compile.py)
    with torch._dynamo.config.patch(recompile_limit=2):  # the limit (8) reached sooner
        result = call_main("ppo_cartpole_gpu", "--compile", *seeds, *short_flags("ppo_cartpole_gpu"), cwd=in_tmp)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: --compile: {cause}") and line.endswith("see docs/modifying.md#compiled-graphs")
    assert __file__ in line if change != "schedule" else "['ent_coef'] == 0.01" in line and "in loss_fn" in line, line


# Train and eval modes -------------------------------------------------------------------------
def with_dropout(module, p: float = 0.2):
    """The script's Agent with dropout after each hidden layer of the actor."""

    class DropoutAgent(module.Agent):
        def __init__(self, *args):
            super().__init__(*args)
            a = self.actor
            self.actor = nn.Sequential(a[0], a[1], nn.Dropout(p), a[2], a[3], nn.Dropout(p), a[4])

    return DropoutAgent


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_dropout_actor_trains_alike_compiled_and_resumed(name, in_tmp, monkeypatch):
    """Dropout in the rollout and the loss (train mode) draws the same masks compiled as eager: inductor's random ops
    fall back to eager's (`fallback_random`). Before, compiled dropout drew from another stream: 0.28 apart."""
    module = import_script(name)
    monkeypatch.setattr(module, "Agent", with_dropout(module))
    assert_same_training(*three_ways(module, monkeypatch, in_tmp))


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_evaluations_play_the_policy_in_eval_mode(name, in_tmp, monkeypatch):
    """The final evaluation and --eval-only of the saved weights play the greedy policy with dropout off, so they
    agree, and the agent is back in train mode afterwards. Before, dropout stayed on: 381.6 against 384.6."""
    module = import_script(name)
    monkeypatch.setattr(module, "Agent", with_dropout(module, p=0.5))
    args = small_args(module, eval_episodes=8, save_model=True)
    agent = module.train(args)
    assert agent.training
    summary = read_json(os.path.join(run_dir(in_tmp, args.exp_name), "summary.json"))
    module.train(replace(args, eval_only=True, load_model=summary["model_path"], exp_name="again", save_model=False))
    again = read_json(os.path.join(run_dir(in_tmp, "again"), "summary.json"))
    assert again["status"] == "evaluated" and again["eval_returns"] == summary["eval_returns"]


# Videos ---------------------------------------------------------------------------------------
@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_capture_video_refuses_an_env_it_cannot_draw_however_it_came(name, in_tmp, monkeypatch):
    """An env added to the --env-id table (here in SpinCart's place) that is not a CartPole: --capture-video is refused
    at start in one line. Before, only an env given to train() was checked: this one trained an iteration, then
    failed in a 17-line AttributeError ('... object has no attribute tau')."""
    module = import_script(name)
    monkeypatch.setitem(module.ENVS, "SpinCart-v1", Pendulum)
    result = call_main(name, "--env-id", "SpinCart-v1", "--capture-video", *short_flags(name), cwd=in_tmp)
    assert_one_error_line(result, "--capture-video must be off for SpinCart-v1: it draws CartPole states, got True")
    # the recurrent recipe's CartPole that observes positions alone (a user's trial: a traceback after iteration 1)
    monkeypatch.setitem(module.ENVS, "SpinCart-v1", type("PositionsCart", (module.CartPole,), {"obs_dim": 2}))
    result = call_main(name, "--env-id", "SpinCart-v1", "--capture-video", *short_flags(name), cwd=in_tmp)
    assert_one_error_line(result, "--capture-video must be off for SpinCart-v1: it draws CartPole states, got True")
    assert not os.path.exists(os.path.join(in_tmp, "runs"))


def test_a_failing_test_that_compiled_shows_no_torch_debug_log(tmp_path):
    """pytest.ini's `log_level`: a failing test that compiled something shows its assertion and the warnings logged,
    not torch.compile's DEBUG trace (before, 3,500 of the 3,605 lines a failing compiled-vs-eager check printed)."""
    compiled = "torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(3))"
    test = f"import torch\n\n\ndef test_fails():\n    {compiled}\n    assert 0\n"
    (tmp_path / "test_fails.py").write_text(test)
    command = [sys.executable, "-m", "pytest", "-c", os.path.join(ROOT, "pytest.ini"), "--rootdir", ROOT,
               "-p", "no:cacheprovider", str(tmp_path / "test_fails.py")]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout[-3000:]
    assert "DEBUG" not in run.stdout and len(run.stdout.splitlines()) < 60, run.stdout[-3000:]


EARLY_TESTS = """
import os, subprocess, sys, pytest
from conftest import start_in_background


def start(folder):
    command = [sys.executable, "-c", "import time; time.sleep(300)"]
    process = start_in_background(command, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.environ["PID_FILE"], "w") as f:
        f.write(f"{process.pid} {os.getpriority(os.PRIO_PROCESS, process.pid)}")
    return process


@pytest.mark.started_early(start=start)
def test_started_early(started_early):
    folder, process = started_early
    at_start = int(open(os.environ["PID_FILE"]).read().split()[1])
    now = 0 if os.geteuid() == 0 else 19  # (raising a priority takes root)
    assert process.poll() is None and at_start == 19 and os.getpriority(os.PRIO_PROCESS, process.pid) == now


def test_other():
    assert "FAIL" not in os.environ
"""


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="nice values are POSIX's")
def test_a_started_early_test_runs_last_and_its_runs_end_with_the_session(tmp_path):
    """`started_early` (Brax's two-seed learning test): its runs start with the session at the lowest priority, it
    runs after the other tests and raises them to normal priority (root can: beside a busy process nice 19 starved
    them), and a session that ends before it (here -x, a test failed) stops its runs."""
    (tmp_path / "test_early.py").write_text(EARLY_TESTS)
    command = [sys.executable, "-m", "pytest", "-c", os.path.join(ROOT, "pytest.ini"), "--rootdir", ROOT, "-p",
               "conftest", "-p", "no:cacheprovider", "-v", "-x", str(tmp_path / "test_early.py")]  # fmt: skip
    pid_file = tmp_path / "pid"
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=os.environ | {"PID_FILE": str(pid_file)})  # fmt: skip
    order = [line.split("::")[1].split()[0] for line in run.stdout.splitlines() if "::" in line]
    assert run.returncode == 0 and order == ["test_other", "test_started_early"], run.stdout[-3000:]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=os.environ | {"PID_FILE": str(pid_file), "FAIL": "1"})  # fmt: skip
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout[-3000:]
    with pytest.raises(ProcessLookupError):  # killed and waited for: gone
        os.kill(int(pid_file.read_text().split()[0]), 0)


# Many seeds -----------------------------------------------------------------------------------
@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("change", ["buffer", "env", "dropout", "continuous", "auxiliary"])
def test_a_change_trains_two_stacked_seeds_and_resumes_them_exactly(change, name, in_tmp, monkeypatch):
    """With --num-seeds 2, a buffer the loss reads and train() anneals, another env (in `make_envs`, where a copy
    adds it), dropout, continuous actions (a Gaussian policy on the continuous Pendulum), and an auxiliary phase in
    the loop (wrapped by run.one_call; before, a traceback) each stay each seed's own in the stacked call, and two
    seeds stopped by SIGTERM and resumed train as the two straight through: the same scalars and weights."""
    from test_many_seeds import folders, stacked_stopped_and_resumed

    module = import_script(name)
    if change == "buffer":
        annealed_buffer(module, monkeypatch)
    if change in ("env", "continuous"):
        envs = Pendulum if change == "env" else ContinuousPendulum
        monkeypatch.setattr(module, "make_envs", lambda args, device, _=None, rank=0: envs(
            args.num_envs, device, args.seed + rank))  # fmt: skip
    if change == "continuous":
        gaussian_actions(module, monkeypatch)
    if change == "dropout":
        monkeypatch.setattr(module, "Agent", with_dropout(module))
    if change == "auxiliary":
        box = auxiliary_phase(module, monkeypatch)
    whole, resumed, _ = stacked_stopped_and_resumed(module, small_args(module, num_seeds=2, eval_episodes=0), in_tmp,
                                                    monkeypatch)  # fmt: skip
    if change == "env":
        assert whole[0].actor[0].in_features == Pendulum.obs_dim
    if change == "continuous":
        assert not torch.equal(whole[0].actor_logstd, whole[1].actor_logstd)
    if change == "buffer":
        assert all(agent.ent_coef < 0.05 for agent in whole)  # annealed, each seed's own (compared in the helper)
    if change == "auxiliary":  # each seed's head trained, its Adam stepped by the phase alone (resumed: its own count)
        iterations = read_json(os.path.join(folders(in_tmp, "whole")[1][0], "summary.json"))["iterations"]
        assert not torch.equal(whole[0].aux_head.weight, whole[1].aux_head.weight)
        assert float(box["aux"].state["flat"]["step"]) == 2 * (iterations // 2)  # the last seed's
    assert not torch.equal(whole[0].actor[0].weight, whole[1].actor[0].weight)


@pytest.mark.parametrize("change, message", [
    ("sgd", "--num-seeds: the seeds' optimizer must be ladder.optim.Adam, whose step vmap runs"),
    ("backward", "--num-seeds: loss.backward() cannot run vmapped: take the gradient with optimizer.backward("),
    ("state", "--num-seeds: run.start(beta=...), a tensor, cannot be each seed's own in the stacked call"),
    ("metric", "stats['charts/weight_sum'] has shape (); run.log takes one number per seed under --num-seeds 2"),
    ("auxiliary", "--num-seeds: call optimizer.backward(...) in a function wrapped by run.one_call(...)"),
])  # fmt: skip
def test_a_change_two_stacked_seeds_cannot_take_is_refused_in_one_line(change, message, in_tmp, monkeypatch):
    """What the stacked call cannot give each seed its own of (the optimizer's step, a tensor the loss reads by
    closure), or cannot run (backward(): vmap has torch.func.grad instead), and a metric that is not per seed (before:
    a traceback from run.log's `torch.stack`), stops the run in one line, and nothing
    before it reads as an error: not seed 1's value silently used for every seed, not 67 lines of traceback (the
    issue's copy with two optimizers), not a result line per seed reading `error: total_env_steps 0, ...`."""
    module = import_script("ppo_cartpole_gpu")
    if change == "sgd":  # torch's, whose step() vmap cannot run
        monkeypatch.setattr(module, "Adam", lambda agent, lr, eps: torch.optim.SGD(agent.parameters(), lr=lr))
    if change == "backward":  # a copy's update calling backward() itself, inside the stacked call
        real_update = module.update
        monkeypatch.setattr(module, "update", lambda *a: torch.ones(1, requires_grad=True).sum().backward() or
                            real_update(*a))  # fmt: skip
    if change == "state":
        adaptive_penalty(module, monkeypatch)
    if change == "auxiliary":  # the phase called on the stacked weights as they are, outside the stacked call
        auxiliary_phase(module, monkeypatch, stacked=False)
    if change == "metric":  # a sum over the stacked weights (all seeds'), added in train() before run.log
        real_log = module.Run.log
        monkeypatch.setattr(module.Run, "log", lambda self, steps, stats, *a: real_log(
            self, steps, stats | {"charts/weight_sum": sum(p.sum() for p in self.agent.parameters())}, *a))  # fmt: skip
    result = call_main("ppo_cartpole_gpu", "--num-seeds", "2", *short_flags("ppo_cartpole_gpu"), cwd=in_tmp)
    assert_one_error_line(result, message)
    assert not [line for line in result.stdout.splitlines() if line.startswith("error")], result.stdout
