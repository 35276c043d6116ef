"""K seeds of PPO on CartPole to a fixed number of env steps each, wall time from launch to the last result, all in:
ppo_cartpole_gpu.py run K times one after another (how K seeds run today), the JAX peer
(benchmarks/jax_ppo_cartpole.py) run K times, and the JAX peer with all K seeds `jax.vmap`ped in one program
(PureJaxRL's headline, which an in-process `--num-seeds K` would have to match). Prints one markdown table with the
command and the machine.

    python benchmarks/many_seeds.py                       # 16 seeds x 500k steps, ~10 minutes on a 2-core CPU
    python benchmarks/many_seeds.py --seeds 4 --steps 200000 --compile
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import jax
import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class ManySeedsArgs:
    seeds: int = 16
    """K: seeds 1..K"""
    steps: int = 500_000
    """env steps per seed (no target: every run goes the whole way)"""
    compile: bool = False
    """one more row: the K sequential runs with --compile (each process compiles)"""


def timed(commands: list[list[str]]) -> float:
    """Seconds to run `commands` one after another, each a fresh process in a scratch folder (cold caches)."""
    start = time.perf_counter()
    for command in commands:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"))
            subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - start


def main() -> None:
    bench = tyro.cli(ManySeedsArgs)
    k, steps = bench.seeds, str(bench.steps)
    ours = [sys.executable, os.path.join(ROOT, "ppo_cartpole_gpu.py"), "--total-timesteps", steps, "--target-return",
            "None", "--eval-episodes", "0", "--no-progress-bar"]  # fmt: skip
    peer = [sys.executable, os.path.join(ROOT, "benchmarks", "jax_ppo_cartpole.py"), "--total-timesteps", steps,
            "--target-return", "inf"]  # fmt: skip
    rows = {f"ppo_cartpole_gpu.py, {k} runs one after another": [ours + ["--seed", str(s)] for s in range(1, k + 1)]}
    if bench.compile:
        rows[f"ppo_cartpole_gpu.py --compile, {k} runs"] = [
            ours + ["--seed", str(s), "--compile"] for s in range(1, k + 1)
        ]
    rows[f"JAX peer, {k} runs one after another"] = [peer + ["--seed", str(s)] for s in range(1, k + 1)]
    rows[f"JAX peer, --num-seeds {k} (vmapped, one process)"] = [peer + ["--seed", "1", "--num-seeds", str(k)]]
    seconds = {}
    for label, commands in rows.items():
        seconds[label] = timed(commands)
        print(f"  {label}: {seconds[label]:.1f} s", file=sys.stderr, flush=True)
    base = next(iter(seconds.values()))
    print(f"\n`python {' '.join(sys.argv)}` on {machine(jax)}, {torch.get_num_threads()} torch threads by default\n")
    print(f"| {k} seeds x {bench.steps:,} steps | wall s, launch to last result | per seed | vs ours, sequential |")
    print("|---|---|---|---|")
    for label, s in seconds.items():
        print(f"| {label} | {s:.1f} | {s / k:.1f} | {base / s:.2f}x |")


if __name__ == "__main__":
    main()
