"""The PPO loss against hand-computed numbers, and ladder's `Run` (its bookkeeping) on scripted rollouts."""

import contextlib
import glob
import importlib
import inspect
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, SCRIPTS, SUMMARY_KEYS, import_script, read_json

pytestmark = pytest.mark.quick  # in the two-minute run: python -m pytest -m quick


# ---------------------------------------------------------------------------------------------
# The PPO loss against numbers worked out by hand
# ---------------------------------------------------------------------------------------------
class FixedPolicy:
    """Stands in for the agent: agent(obs, actions) (or .evaluate) returns fixed new log-probs, entropies, values."""

    def __init__(self, logprob, entropy, value):
        self.out = tuple(torch.tensor(x, dtype=torch.float64) for x in (logprob, entropy, value))

    def __call__(self, obs, actions):
        return self.out

    evaluate = __call__


# three samples with ratios 1.5, 0.5 and 1.1 (clipped at 0.8 and 1.2), advantages 1, -1 and 2
RATIO = [1.5, 0.5, 1.1]
OLD_LOGPROB = [0.0, 0.0, 0.0]
ADVANTAGES = [1.0, -1.0, 2.0]
ENTROPY = [0.5, 0.6, 0.7]
NEW_VALUE, RETURNS, OLD_VALUE = [1.0, 2.0, 0.0], [1.5, 1.0, 0.0], [1.0, 1.0, 1.0]
# policy loss: max(-A r, -A clip(r)) = max(-1.5, -1.2), max(0.5, 0.8), max(-2.2, -2.2) -> mean(-1.2, 0.8, -2.2)
PG_LOSS = (-1.2 + 0.8 - 2.2) / 3
CLIPFRAC = 2 / 3  # |r - 1| > 0.2 for the first two
APPROX_KL = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5)) + (0.1 - math.log(1.1))) / 3  # mean((r - 1) - log r)
V_LOSS = 0.5 * (0.25 + 1.0 + 0.0) / 3  # ½ mean((V - R)²)
# clipped: V_old + clip(V - V_old, ±0.2) = 1.0, 1.2, 0.8 -> squared errors 0.25, 0.04, 0.64; the max per sample
V_LOSS_CLIPPED = 0.5 * (0.25 + 1.0 + 0.64) / 3
PPO_SCRIPTS = ["ppo_cartpole_gpu", "ppo_atari_envpool", "ppo_mujoco_brax"]


@pytest.mark.parametrize("name", PPO_SCRIPTS)
@pytest.mark.parametrize("clip_vloss", [False, True])
def test_ppo_loss_matches_hand_computed_values(name, clip_vloss):
    mod = import_script(name)
    if clip_vloss and not hasattr(mod.Args, "clip_vloss"):
        pytest.skip(f"{name} has no --clip-vloss")
    flags = dict(clip_coef=0.2, norm_adv=False, ent_coef=0.01, vf_coef=0.5)
    if hasattr(mod.Args, "clip_vloss"):
        flags["clip_vloss"] = clip_vloss
    args = mod.Args(**flags)
    agent = FixedPolicy(np.log(RATIO), ENTROPY, NEW_VALUE)
    t = lambda x: torch.tensor(x, dtype=torch.float64)
    batch = mod.Batch(
        obs=None,
        actions=None,
        logprobs=t(OLD_LOGPROB),
        advantages=t(ADVANTAGES),
        returns=t(RETURNS),
        values=t(OLD_VALUE),
        **({"mask": t(np.ones(len(ADVANTAGES)))} if "mask" in mod.Batch._fields else {}),  # Atari's: every row kept
    )  # fields by name: an order change cannot mix them up
    loss, stats = mod.ppo_loss(agent, args, batch)
    v_loss = V_LOSS_CLIPPED if clip_vloss else V_LOSS
    expected = {
        "losses/policy_loss": PG_LOSS,
        "losses/value_loss": v_loss,
        "losses/entropy": 0.6,
        "losses/approx_kl": APPROX_KL,
        "losses/clipfrac": CLIPFRAC,
        "losses/total_loss": PG_LOSS - 0.01 * 0.6 + 0.5 * v_loss,
    }
    assert set(stats) == set(expected)
    for tag, value in expected.items():
        assert stats[tag].item() == pytest.approx(value, abs=1e-7), tag  # clipfrac is float32
    assert loss.item() == pytest.approx(expected["losses/total_loss"], abs=1e-9)


@pytest.mark.parametrize("name", ["ppo_cartpole_gpu", "vpg", "ppo_atari_envpool", "ppo_mujoco_brax"])
def test_explained_variance_is_nan_for_constant_returns(name):
    mod = import_script(name)
    kept = lambda n: (torch.ones(n),) if name == "ppo_atari_envpool" else ()  # noqa: E731 (Atari's mask: all rows)
    assert math.isnan(mod.explained_variance(torch.tensor([0.5, 0.2]), torch.ones(2), *kept(2)).item())
    values, returns = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 4.0])
    expected = 1 - (returns - values).var() / returns.var()
    assert mod.explained_variance(values, returns, *kept(3)).item() == pytest.approx(expected.item())


# ---------------------------------------------------------------------------------------------
# Run: the bookkeeping on scripted rollouts
# ---------------------------------------------------------------------------------------------
import ppo_cartpole_gpu as P  # noqa: E402
from ladder.flags import UsageError  # noqa: E402
from ladder.run import Run  # noqa: E402


def episodes(returns):
    """What `run.log` takes of a rollout: the episodes that ended, as (ended, return, length) tensors."""
    returns = torch.tensor(returns, dtype=torch.float32)
    return torch.ones(len(returns), dtype=torch.bool), returns, returns.int()


def scripted_run(in_tmp, rollouts, stats=None, evaluate=P.evaluate, **flags):
    args = P.Args(**dict(progress_bar=False, eval_episodes=0, save_model=True, anneal_lr=False) | flags)
    agent = P.Agent(4, 2)
    optimizer = torch.optim.Adam(agent.parameters())
    stats = stats or {"losses/total_loss": torch.tensor(0.5), "losses/explained_variance": torch.tensor(float("nan"))}
    stopped_at = None
    with Run(args, evaluate, P.record_video) as run:
        run.start(agent, P.CartPole(4), optimizer, total_steps=1000 * len(rollouts))
        for i, returns in enumerate(rollouts, 1):
            run.log(1000, stats, episodes(returns))
            if run.target_reached():
                stopped_at = i
                break
    (path,) = glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))
    return read_json(path), stopped_at


def test_run_counts_episodes_and_the_100_episode_window(in_tmp):
    # 60 episodes of 100, then 60 of 480, then 60 of 500: the window of 100 first reaches 475 at the third log
    rollouts = [[100.0] * 60, [480.0] * 60, [500.0] * 60]
    summary, stopped_at = scripted_run(in_tmp, rollouts, target_return=490.0)
    assert set(summary) == SUMMARY_KEYS
    assert summary["episodes"] == 180 and summary["total_env_steps"] == 3000 and summary["iterations"] == 3
    assert summary["mean_return_last_100"] == pytest.approx((40 * 480 + 60 * 500) / 100)  # 492: target reached
    assert stopped_at == 3 and summary["status"] == "target return reached"
    assert summary["solved_threshold"] == 475.0 and summary["solved_at_step"] == 3000  # 328 at step 2000
    assert summary["model_path"].endswith("ppo_cartpole_gpu.cleanrl_model") and os.path.exists(summary["model_path"])
    assert summary["eval_returns"] is None and summary["args"]["target_return"] == 490.0


def test_run_without_target_runs_every_iteration(in_tmp):
    summary, stopped_at = scripted_run(in_tmp, [[500.0] * 100, [], [500.0]], target_return=None)
    assert stopped_at is None and summary["status"] == "completed" and summary["episodes"] == 101
    assert summary["solved_at_step"] == 1000  # solved, but there was no target to stop at


def test_the_target_stops_a_run_once_the_evaluation_reaches_it_too(in_tmp, monkeypatch, capsys):
    """A sampling policy can reach the target while the evaluated one falls short (Brax's inverted_pendulum, seed 1 on
    an Intel Xeon: a 100-episode mean of 905, its mean action 749). The run trains on and asks again once 100 more
    episodes have ended; it stops when the evaluation reaches the target, whose returns the summary keeps."""
    scores, calls = iter([[400.0] * 3, [500.0] * 3]), []
    evaluate = lambda agent, envs, args, video: calls.append(video) or next(scores)
    rollouts = [[500.0] * 100, [500.0] * 50, [500.0] * 60, [500.0] * 10]
    summary, stopped_at = scripted_run(in_tmp, rollouts, eval_episodes=3, evaluate=evaluate)
    # 1: evaluated 400, trains on; 2: 50 episodes later, not asked; 3: 110 later, evaluated 500: stops
    assert stopped_at == 3 and calls == [None, None] and summary["status"] == "target return reached"
    assert summary["eval_returns"] == [500.0] * 3  # the confirming evaluation's: not played a third time
    err = capsys.readouterr().err
    assert err.count("reached the target: evaluating the policy to confirm") == 2 and "is 400.0: training on" in err


def test_a_real_untrained_policy_does_not_confirm_the_target(in_tmp):
    """An untrained agent's greedy policy does not balance for 500 steps: scripted returns of 500 do not stop it."""
    torch.manual_seed(0)  # about one untrained net in 40 balances (seed 24 does): this one does not
    summary, stopped_at = scripted_run(in_tmp, [[500.0] * 100, [500.0] * 100], eval_episodes=4)
    assert stopped_at is None and summary["status"] == "completed" and summary["eval_mean_return"] < 500


@pytest.mark.parametrize("target, refused", [(490.0, True), (None, False)])
def test_resuming_a_run_that_reached_its_target_is_refused_unless_the_target_changes(in_tmp, target, refused):
    """A finished run resumed would train one more iteration and evaluate again, overwriting its summary."""
    scripted_run(in_tmp, [[500.0] * 100, [500.0] * 100], target_return=490.0)
    (folder,) = glob.glob(str(in_tmp / "runs" / "*"))
    agent = P.Agent(4, 2)
    args = P.Args(progress_bar=False, eval_episodes=0, target_return=target, resume=folder, anneal_lr=False)
    ended = "the run has ended; to train on, pass --target-return None, or a higher one"
    expected = pytest.raises(UsageError, match=ended) if refused else contextlib.nullcontext()
    with expected, Run(args, P.evaluate, P.record_video) as run:
        run.start(agent, P.CartPole(4), torch.optim.Adam(agent.parameters()), total_steps=10_000)


def test_the_progress_bar_on_a_terminal_names_the_target_that_may_end_the_run_early(in_tmp, monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    scripted_run(in_tmp, [[10.0], [10.0]], progress_bar=True, target_return=490.0)
    assert "until return 490: 100%" in capsys.readouterr().err


def test_run_stops_on_a_non_finite_loss_and_keeps_no_weights(in_tmp):
    stats = {"losses/total_loss": torch.tensor(float("nan"))}
    with pytest.raises(FloatingPointError, match="non-finite loss at iteration 1 \\(env step 1000\\)"):
        scripted_run(in_tmp, [[10.0]], stats=stats)
    (path,) = glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))
    summary = read_json(path)
    assert summary["status"] == "non-finite loss" and summary["model_path"] is None


def test_run_writes_everything_on_ctrl_c(in_tmp):
    args = P.Args(progress_bar=False, eval_episodes=3, save_model=True, anneal_lr=False)
    agent = P.Agent(4, 2)
    with pytest.raises(KeyboardInterrupt):
        with Run(args, P.evaluate, P.record_video) as run:
            run.start(agent, P.CartPole(4), torch.optim.Adam(agent.parameters()), total_steps=10)
            run.log(10, {"losses/total_loss": torch.tensor(1.0)}, episodes([20.0, 30.0]))
            raise KeyboardInterrupt
    (path,) = glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))
    summary = read_json(path)
    assert summary["status"] == "interrupted" and summary["episodes"] == 2 and summary["mean_return_last_100"] == 25.0
    assert os.path.exists(summary["model_path"]) and summary["eval_returns"] is None  # no evaluation when cut short


# ---------------------------------------------------------------------------------------------
# Portability: no Linux-only call on start-up, no process-wide change inside train()
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SCRIPTS)
def test_main_runs_without_sched_getaffinity(name, in_tmp, monkeypatch, capsys):
    """macOS and Windows have no os.sched_getaffinity."""
    mod = import_script(name)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(sys, "argv", [name, "--total-timesteps", "5000", "--no-progress-bar", "--eval-episodes", "0",
                                      "--num-envs", "8", "--device", "cpu"])  # fmt: skip
    threads = torch.get_num_threads()
    try:
        mod.main()
    finally:
        torch.set_num_threads(threads)
    assert "completed" in capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_train_leaves_the_thread_count_alone(name, in_tmp):
    mod = import_script(name)
    threads = torch.get_num_threads()
    mod.train(mod.Args(torch_threads=threads + 1, total_timesteps=5000, num_envs=8, progress_bar=False,
                       eval_episodes=0, device="cpu"))  # fmt: skip
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("num_envs", [128, 1024])
def test_default_thread_count(name, num_envs, monkeypatch):
    """--torch-threads 0: the CartPole and Brax scripts take one thread below 1024 envs, all cores from there on;
    Atari's CNN always all cores. An explicit count wins."""
    mod = import_script(name)
    chosen = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(mod.torch, "set_num_threads", chosen.append)
    monkeypatch.setattr(mod, "train", lambda args: None)
    for threads in (0, 3):
        monkeypatch.setattr(sys, "argv", [name, "--num-envs", str(num_envs), "--device", "cpu",
                                          "--torch-threads", str(threads)])  # fmt: skip
        mod.main()
    one_below_1024 = name != "ppo_atari_envpool"
    assert chosen == [1 if one_below_1024 and num_envs < 1024 else 4, 3]


@pytest.mark.parametrize("name", SCRIPTS)
def test_openmp_threads_sleep_when_idle_unless_told_otherwise(name):
    """OMP_WAIT_POLICY=PASSIVE is set before torch loads OpenMP (a spinning thread starves ours on a busy machine),
    and a value the user exported is kept: checked on the first script, the others setting it by the same line."""
    module = import_script(name)  # skips where the simulator is not installed
    line = 'os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")'
    assert line in inspect.getsource(module)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import os, sys; sys.path.insert(0, {root!r}); import {name}, torch; print(os.environ['OMP_WAIT_POLICY'])"
    cases = [(None, "PASSIVE")] + ([("ACTIVE", "ACTIVE")] if name == SCRIPTS[0] else [])
    for exported, expected in cases:
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if exported:
            env["OMP_WAIT_POLICY"] = exported
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split()[-1] == expected


def test_benchmark_machine_line_without_sched_getaffinity(monkeypatch):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    common = importlib.import_module("common")
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert f"{os.cpu_count()} cores" in common.machine()


@pytest.mark.parametrize("total", [5_000_000, 2_010])
def test_run_says_when_total_timesteps_is_rounded_down(in_tmp, capsys, total):
    """2 scripted rollouts of 1,000 steps: 5,000,000 or 2,010 (0.5% lost, like 200,000 -> 198,656) name both numbers."""
    scripted_run(in_tmp, [[10.0], [10.0]], total_timesteps=total, num_envs=8)
    err = capsys.readouterr().err
    assert f"note: --total-timesteps {total:,} is rounded down to whole rollouts: 2,000" in err


def test_run_keeps_quiet_about_a_rounding_under_a_thousandth(in_tmp, capsys):
    """The defaults' 5,000,000 -> 4,999,168 (2,048-step rollouts, 0.02%) is not worth a line in every run."""
    scripted_run(in_tmp, [[10.0], [10.0]], total_timesteps=2_001, num_envs=8)
    assert "rounded down" not in capsys.readouterr().err


def test_readmes_sketch_of_train_is_in_the_code():
    """README's outline of ppo_cartpole_gpu.py's train(): every line of it with code in it (a call) is a line of the
    code, so the sketch cannot drift from what it shows."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    sketch = readme.split("```python\n", 1)[1].split("```", 1)[0]
    source = {
        line.split("  #")[0].strip() for line in inspect.getsource(import_script("ppo_cartpole_gpu").train).splitlines()
    }
    code = [line.split("  #")[0].strip() for line in sketch.splitlines() if "(" in line]
    assert len(code) >= 7 and all(line in source for line in code), [line for line in code if line not in source]


def test_ctrl_c_after_a_sigterm_stops_at_once(in_tmp):
    """After SIGTERM asked for a stop at the end of the iteration, a Ctrl-C does not wait for it: KeyboardInterrupt."""
    import signal
    import time

    agent = P.Agent(4, 2)
    with pytest.raises(KeyboardInterrupt) as stopped:
        with Run(P.Args(progress_bar=False, eval_episodes=0, anneal_lr=False), P.evaluate, P.record_video) as run:
            run.start(agent, P.CartPole(4), torch.optim.Adam(agent.parameters()), total_steps=10)
            run.signals.request(signal.SIGTERM, None)  # what the SIGTERM handler does
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the KeyboardInterrupt comes at once
    assert not stopped.value.args  # a plain KeyboardInterrupt, not the end-of-iteration stop (which carries a signal)
    (path,) = glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))
    assert read_json(path)["status"] == "interrupted"


@pytest.mark.parametrize("where, steps, iterations", [("gradient_step", "0", 0), ("evaluate", "2,048", 4)])
def test_a_run_a_bug_stops_says_where_its_outputs_are_without_reading_as_an_error_line(
    where, steps, iterations, in_tmp, monkeypatch, capsys
):
    """A bug in a copy, in training (its gradient step) or in the final evaluation (its `evaluate`; Brax's video of
    hopper, whose `dt` is a JAX array), ends the run with Python's traceback; summary.json (status `error`) and the
    result line are written before it, the line naming the outputs and not starting as a refusal's one `error:` line
    does (it read `error: total_env_steps 0, ...`). Before, an error in the final evaluation left no summary.json and
    no line said where the run was."""
    module = import_script("ppo_cartpole_gpu")

    def broken(*args):
        raise RuntimeError("a bug in a copy")

    monkeypatch.setattr(module, where, broken)
    with pytest.raises(RuntimeError, match="a bug in a copy"):
        module.train(module.Args(num_envs=32, num_steps=16, total_timesteps=2048, progress_bar=False, device="cpu"))
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"stopped by the error below: total_env_steps {steps}") and "; outputs in runs" in line, line
    (summary,) = glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))
    assert read_json(summary)["status"] == "error" and read_json(summary)["iterations"] == iterations
