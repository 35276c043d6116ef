"""A learning-rate sweep, wall time from launch to the last result, all in one run: ppo_cartpole_gpu.py once per
configuration and seed, one after another (CleanRL's tuner runs them so); the same grid as one `--sweep` in one process,
eager and `--compile`d (warm inductor cache; the cold compile printed apart); and the JAX peer
(benchmarks/jax_ppo_cartpole.py) vmapped over the rates and seeds in one program. Prints markdown tables with the
command and the machine.

    python benchmarks/sweep.py                       # 4 rates x 4 seeds x 500k steps, ~25 minutes on 2 cores
    python benchmarks/sweep.py --seeds 2 --steps 100000 --rates 1e-3 5e-3
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field

import jax
import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from many_seeds import ROOT, table, timed  # noqa: E402

from common import machine  # noqa: E402


@dataclass
class SweepArgs:
    rates: list[float] = field(default_factory=lambda: [1e-3, 2.5e-3, 5e-3, 1e-2])
    """the learning rates swept"""
    seeds: int = 4
    """seeds of each rate"""
    steps: int = 500_000
    """env steps per run (no target: every run goes the whole way)"""
    compile: bool = True
    """a row for the sweep with --compile on a warm inductor cache"""


def main() -> None:
    bench = tyro.cli(SweepArgs)
    py, runs, steps = sys.executable, len(bench.rates) * bench.seeds, str(bench.steps)
    rates = ",".join(f"{rate:g}" for rate in bench.rates)
    ours = [py, os.path.join(ROOT, "ppo_cartpole_gpu.py"), "--total-timesteps", steps, "--target-return", "None",
            "--no-progress-bar"]  # fmt: skip
    sweep = ours + ["--sweep", f"learning-rate={rates}", "--num-seeds", str(bench.seeds)]
    one_by_one = [ours + ["--learning-rate", f"{r:g}", "--seed", str(s)] for r in bench.rates
                  for s in range(1, bench.seeds + 1)]  # fmt: skip
    rows = {f"ppo_cartpole_gpu.py, {runs} runs one after another": one_by_one}
    rows[f"ppo_cartpole_gpu.py --sweep ({runs} runs in one process)"] = [sweep]
    if bench.compile:  # on a warm cache: a first run fills it (the time a first run of these flags takes)
        cache = tempfile.mkdtemp()
        cold, _, (compiling, _) = timed([sweep + ["--compile"]], cache)
        print(f"  --compile, cold cache: {cold:.1f} s, {compiling:.1f} s of it compiling", file=sys.stderr)
        rows[f"ppo_cartpole_gpu.py --sweep --compile (warm cache; cold: {cold:.0f} s)"] = (
            [sweep + ["--compile"]],
            cache,
        )
    peer = [py, os.path.join(ROOT, "benchmarks", "jax_ppo_cartpole.py"), "--total-timesteps", steps,
            "--target-return", "inf", "--learning-rates", rates, "--num-seeds", str(bench.seeds)]  # fmt: skip
    rows[f"JAX peer, {len(bench.rates)} rates x {bench.seeds} seeds vmapped in one program"] = [peer]
    title = f"{len(bench.rates)} learning rates x {bench.seeds} seeds x {bench.steps:,} steps"
    seconds = list(table(title, rows, runs).items())
    sequential, jax_s = seconds[0][1], seconds[-1][1]
    for label, s in seconds[1:-1]:
        print(f"\n{label}: {sequential / s:.2f}x the runs one after another, {jax_s / s:.2f}x the JAX peer")
    print(f"\n`python {' '.join(sys.argv)}` on {machine(jax)}, {torch.get_num_threads()} torch threads by default")


if __name__ == "__main__":
    main()
