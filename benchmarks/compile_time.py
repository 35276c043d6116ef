"""How long --compile takes before training starts, cold (a fresh inductor cache) and warm (the same cache again):
ppo_cartpole_gpu.py and vpg.py as written (CartPole) and ppo_cartpole_gpu.py with docs/modifying.md's
continuous-actions recipe (a Gaussian policy on a tensor Pendulum), each run in a fresh process, with
ladder.compile's setting (on a CPU, an intermediate stored once it holds 30 ops: inductor's GPU default) and with
inductor's CPU default (50), for this checkout and for others given by --roots (a `git worktree` of an older commit:
the same numbers before and after a change). Prints one markdown table with the command and the machine.

Why it matters: at 50, a recurrence unrolled over the rollout's T steps (the env's state through sin, clamp, where)
is inlined into each step's kernels, so the generated code grows much faster than T: the Pendulum copy's first
iteration had not compiled after 15 minutes at T=16. And what one graph holds sets the time: PPO's 16 minibatch
steps unrolled in one graph compile 2.3x as long as one epoch's 4 (issue 66).

    python benchmarks/compile_time.py --envs cartpole --thresholds 30 --repeats 3     # the defaults' compile
    git worktree add /tmp/before 6217ab8 && python benchmarks/compile_time.py --envs cartpole --thresholds 30 \
        --roots . /tmp/before --scripts ppo_cartpole_gpu vpg                            # before and after
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from common import machine  # noqa: E402


@dataclass
class BenchArgs:
    envs: tuple[str, ...] = ("cartpole", "pendulum")
    """cartpole: the script as written; pendulum: the continuous-actions recipe (ppo_cartpole_gpu.py only)"""
    scripts: tuple[str, ...] = ("ppo_cartpole_gpu",)
    """the scripts to compile (ppo_cartpole_gpu, vpg)"""
    roots: tuple[str, ...] = (os.path.dirname(HERE),)
    """checkouts whose scripts and ladder/ are measured (a `git worktree` of another commit)"""
    thresholds: tuple[int, ...] = (30, 50)
    """inductor's realize_cpu_opcount_threshold: 30 is ladder.compile's, 50 inductor's default"""
    iterations: int = 21
    """iterations per run (128 envs x 16 steps, the defaults); the first compiles, the others give the SPS"""
    repeats: int = 1
    """cold-then-warm pairs per row, each with a fresh cache (the table shows the mean and the range)"""
    timeout: float = 900.0
    """seconds a run may take before it is stopped and shown as "> timeout" """


def one_run(root: str, script: str, env: str, threshold: int, iterations: int) -> dict:
    """In this (fresh) process: train `root`'s `script` with --compile for `iterations` and time it; the first
    iteration's seconds are the run's wall time less the other iterations' at the run's SPS."""
    import importlib

    import pytest
    import torch

    sys.path.insert(0, root)
    ours = importlib.import_module(script)
    compile_ = torch.compile  # ladder.compile.compiled's call, its threshold replaced
    options = {"options": {"realize_cpu_opcount_threshold": threshold}}
    torch.compile = lambda fn, **kwargs: compile_(fn, **kwargs | options)
    torch.set_num_threads(1)
    envs = None
    if env == "pendulum":
        sys.path.insert(0, os.path.join(root, "tests"))
        from test_modifications import ContinuousPendulum, gaussian_actions

        gaussian_actions(ours, pytest.MonkeyPatch())
        envs = ContinuousPendulum(128, "cpu", seed=1)
    args = ours.Args(total_timesteps=iterations * 16 * 128, target_return=None, eval_episodes=0, progress_bar=False,
                     device="cpu", compile=True)  # fmt: skip
    from common import train_and_summarize

    start = time.perf_counter()
    summary = train_and_summarize(_Train(ours, envs), args)
    wall = time.perf_counter() - start
    return {"first_iteration_s": wall - (iterations - 1) * 16 * 128 / summary["mean_sps"], "sps": summary["mean_sps"]}


class _Train:
    """`module` with its train() given `envs` (None: the script's own)."""

    def __init__(self, module, envs):
        self.module, self.envs = module, envs

    def train(self, args):
        return self.module.train(args, self.envs)


def timed(bench: BenchArgs, one: list[str], cache: str) -> dict | None:
    """`one_run` in a fresh process with inductor's cache in `cache`; None past the timeout."""
    environ = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--one", *one, str(bench.iterations)]
    try:
        done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=bench.timeout)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return None
    except (json.JSONDecodeError, IndexError):
        sys.exit(f"error: {' '.join(one)} failed:\n{done.stderr[-3000:]}")


def shown(values: list[float], digits: int = 1) -> str:
    """The mean, and the range when there are several."""
    mean = f"{statistics.mean(values):,.{digits}f}"
    return mean if len(values) == 1 else f"{mean} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        root, script, env, threshold, iterations = sys.argv[2:7]
        print(json.dumps(one_run(root, script, env, int(threshold), int(iterations))))
        return
    bench = tyro.cli(BenchArgs)
    rows = {}
    for root, script, env, threshold in itertools.product(bench.roots, bench.scripts, bench.envs, bench.thresholds):
        if env == "pendulum" and script != "ppo_cartpole_gpu" or not os.path.exists(f"{root}/{script}.py"):
            continue
        key, one = (root, script, env, threshold), [os.path.abspath(root), script, env, str(threshold)]
        rows[key] = []
        for _ in range(bench.repeats):
            with tempfile.TemporaryDirectory() as cache:  # cold: nothing compiled before; then warm: all of it
                rows[key].append((timed(bench, one, cache), timed(bench, one, cache)))
            print(f"{' '.join(one)}: {rows[key][-1]}", file=sys.stderr)
    print(f"`python benchmarks/compile_time.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print(f"\n{machine()}; one torch thread, 128 envs x 16 steps; cold: a fresh inductor cache, warm: that cache again")
    print(f"({bench.repeats} pair(s) each: the mean and the range)\n")
    print("| checkout | script | env | realize_cpu_opcount_threshold | first iteration cold, s | warm, s | SPS after |")
    print("|---|---|---|---|---|---|---|")
    for (root, script, env, threshold), pairs in rows.items():
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        name = {"cartpole": "CartPole (as written)", "pendulum": "continuous Pendulum (Gaussian recipe)"}[env]
        setting = f"{threshold}" + (" (ladder's)" if threshold == 30 else " (inductor's default)" * (threshold == 50))
        cells = f"| {commit.stdout.strip()} | {script}.py | {name} | {setting} |"
        if any(run is None for pair in pairs for run in pair):
            print(f"{cells} > {bench.timeout:.0f} | – | – |")
            continue
        cold, warm = [p[0]["first_iteration_s"] for p in pairs], [p[1]["first_iteration_s"] for p in pairs]
        sps = [run["sps"] for pair in pairs for run in pair]
        print(f"{cells} {shown(cold)} | {shown(warm)} | {shown(sps, 0)} |")


if __name__ == "__main__":
    main()
