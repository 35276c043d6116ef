"""How long --compile takes before training starts: ppo_cartpole_gpu.py as written (CartPole) and with
docs/modifying.md's continuous-actions recipe (a Gaussian policy on a tensor Pendulum), each compiled cold (a fresh
inductor cache) in a fresh process, with ladder.compile's setting (on a CPU, an intermediate stored once it holds 30
ops: inductor's GPU default) and with inductor's CPU default (50). Prints one markdown table with the command and
the machine.

Why it matters: at 50, a recurrence unrolled over the rollout's T steps (the env's state through sin, clamp, where)
is inlined into each step's kernels, so the generated code grows much faster than T: the Pendulum copy's first
iteration had not compiled after 15 minutes at T=16.

    python benchmarks/compile_time.py                                 # both envs, both settings, 1 torch thread
    python benchmarks/compile_time.py --thresholds 30 --envs cartpole  # one row
"""

from __future__ import annotations

import json
import os
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
    """cartpole: the script as written; pendulum: the continuous-actions recipe (tests/test_modifications.py)"""
    thresholds: tuple[int, ...] = (30, 50)
    """inductor's realize_cpu_opcount_threshold: 30 is ladder.compile's, 50 inductor's default"""
    iterations: int = 21
    """PPO iterations per run (128 envs x 16 steps, the defaults); the first compiles, the others give the SPS"""
    timeout: float = 900.0
    """seconds a run may take before it is stopped and shown as "> timeout" """


def one_run(env: str, threshold: int, iterations: int) -> dict:
    """In this (fresh) process: train with --compile for `iterations` and time it; the first iteration's seconds
    are the run's wall time less the other iterations' at the run's SPS."""
    import pytest
    import torch

    import ppo_cartpole_gpu as ours

    compile_ = torch.compile  # ladder.compile.compiled's call, its threshold replaced
    options = {"options": {"realize_cpu_opcount_threshold": threshold}}
    torch.compile = lambda fn, **kwargs: compile_(fn, **kwargs | options)
    torch.set_num_threads(1)
    envs = None
    if env == "pendulum":
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
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


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        env, threshold, iterations = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(one_run(env, threshold, iterations)))
        return
    bench = tyro.cli(BenchArgs)
    rows = {}
    for env in bench.envs:
        for threshold in bench.thresholds:
            with tempfile.TemporaryDirectory() as cache:  # cold: nothing compiled before
                environ = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
                command = [sys.executable, __file__, "--one", env, str(threshold), str(bench.iterations)]
                try:
                    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=bench.timeout)
                    rows[env, threshold] = json.loads(done.stdout.strip().splitlines()[-1])
                except subprocess.TimeoutExpired:
                    rows[env, threshold] = None
                except (json.JSONDecodeError, IndexError):
                    sys.exit(f"error: {env} at {threshold} failed:\n{done.stderr[-3000:]}")
            print(f"{env}, threshold {threshold}: {rows[env, threshold]}", file=sys.stderr)
    print(f"`python benchmarks/compile_time.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print(f"\n{machine()}; one torch thread, 128 envs x 16 steps, a fresh inductor cache per run\n")
    print("| env | realize_cpu_opcount_threshold | first iteration (compiling), s | compiled SPS after |")
    print("|---|---|---|---|")
    for (env, threshold), row in rows.items():
        name = {"cartpole": "CartPole (as written)", "pendulum": "continuous Pendulum (Gaussian recipe)"}[env]
        setting = f"{threshold}" + (" (ladder's)" if threshold == 30 else " (inductor's default)" * (threshold == 50))
        if row is None:
            print(f"| {name} | {setting} | > {bench.timeout:.0f} | – |")
        else:
            print(f"| {name} | {setting} | {row['first_iteration_s']:.1f} | {row['sps']:,.0f} |")


if __name__ == "__main__":
    main()
