"""What --compile gains for a copy's changes: ppo_cartpole_gpu.py's training SPS eager and compiled, as written,
with AdamW in two param groups and with a first layer shared by actor and critic, side by side in one run. All take
the script's own gradient_step compiled (ladder.optim.Adam: one path). Prints one markdown table with the command
and the machine.

    python benchmarks/compile_modes.py                       # 128 and 4096 envs, 300k steps (at least 20 iterations)
    python benchmarks/compile_modes.py --num-envs 4096 --repeats 3
"""

from __future__ import annotations

import io
import os
import statistics
import sys
from contextlib import redirect_stdout
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_cartpole_gpu as ours  # noqa: E402
from common import cores, machine, train_and_summarize  # noqa: E402
from ladder.optim import Adam  # noqa: E402


@dataclass
class BenchArgs:
    num_envs: tuple[int, ...] = (128, 4096)
    """env counts to measure (one torch thread below the script's THREADED_FROM_ENVS, all cores from it, as main())"""
    steps: int = 300_000
    """env steps per training run, at least 20 iterations' (the compiling iteration is not counted in SPS)"""
    repeats: int = 1
    """measure every row this many times, round-robin (shared machines drift): the median and the range"""


class SharedFirstLayer(ours.Agent):
    """The actor's first layer is the critic's: a parameter in two places."""

    def __init__(self, *args):
        super().__init__(*args)
        self.actor[0] = self.critic[0]


def adamw_two_groups(agent, lr, **kwargs):
    """AdamW's decay on the weight matrices only (train() calls it as it calls ladder.optim.Adam)."""
    params = list(agent.parameters())
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": 1e-2},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]  # fmt: skip
    return Adam(agent, groups, lr=lr, **kwargs)


CHANGES = {"plain Adam (as written)": {}, "AdamW, two param groups": {"Adam": adamw_two_groups},
           "first layer shared by actor and critic": {"Agent": SharedFirstLayer}}  # fmt: skip


def sps(change: dict, num_envs: int, steps: int, compile: bool) -> float:
    """Training SPS of ppo_cartpole_gpu.py with `change` made (names in the script)."""
    adam, agent = ours.Adam, ours.Agent
    ours.Adam, ours.Agent = change.get("Adam", adam), change.get("Agent", agent)
    torch.set_num_threads(cores() if num_envs >= ours.THREADED_FROM_ENVS else 1)
    try:
        args = ours.Args(num_envs=num_envs, total_timesteps=max(steps, 20 * 16 * num_envs), target_return=None,
                         eval_episodes=0, progress_bar=False, device="cpu", compile=compile)  # fmt: skip
        with redirect_stdout(io.StringIO()):  # the runs' result lines
            return train_and_summarize(ours, args)["mean_sps"]
    finally:
        ours.Adam, ours.Agent = adam, agent


def main() -> None:
    bench = tyro.cli(BenchArgs)
    runs = {(name, n, c): [] for n in bench.num_envs for name in CHANGES for c in (False, True)}
    for _ in range(bench.repeats):
        for name, n, c in runs:
            runs[name, n, c].append(sps(CHANGES[name], n, bench.steps, c))
            print(f"{name}, {n} envs, {'compiled' if c else 'eager'}: {runs[name, n, c][-1]:,.0f} SPS", file=sys.stderr)
    show = lambda xs: f"{statistics.median(xs):,.0f}" + (f" ({min(xs):,.0f}–{max(xs):,.0f})" if len(xs) > 1 else "")
    print(f"`python benchmarks/compile_modes.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print(f"\n{machine()}; {bench.steps:,} steps per run (at least 20 iterations), median of {bench.repeats}\n")
    print("| change | envs | eager SPS | --compile SPS | compiled / eager |")
    print("|---|---|---|---|---|")
    for name in CHANGES:
        for n in bench.num_envs:
            eager, fast = runs[name, n, False], runs[name, n, True]
            ratio = statistics.median(fast) / statistics.median(eager)
            print(f"| {name} | {n} | {show(eager)} | {show(fast)} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
