"""CleanRL's own `cleanrl/ppo.py`, unmodified, beside `ppo_cartpole_gpu.py` on CartPole-v1: from launch to a
100-episode mean return of 475, the training time to it, the SPS, and the env steps to it. Seeds 1-3, one run after
the other (nothing else should run); CleanRL with torch's default threads and with OMP_NUM_THREADS=1. Prints one
markdown table with the command and the machine.

Nothing of CleanRL is in this repository. Get it at the commit measured, in a virtualenv of its own: CleanRL's ppo.py
reads `infos["final_info"]`, which gymnasium 1.x no longer gives (under this repository's gymnasium it logs no
episodic return at all), so it runs under the gymnasium and numpy it pins (0.29.1, 1.26), with the same torch:

    git clone https://github.com/vwxyzjn/cleanrl ~/cleanrl && git -C ~/cleanrl checkout fe8d8a0
    python3.11 -m venv ~/cleanrl-venv
    ~/cleanrl-venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    ~/cleanrl-venv/bin/pip install gymnasium==0.29.1 numpy==1.26.4 tyro==1.0.17 tensorboard==2.21.0

    python benchmarks/cleanrl_real.py --cleanrl ~/cleanrl --python ~/cleanrl-venv/bin/python

CleanRL trains its default 500k steps (it has no early stop); `ppo_cartpole_gpu.py` stops at its target (475,
confirmed by an evaluation). Both reach 475 by the same rule: the mean of the last 100 episodes' returns.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass

import tyro
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import machine  # noqa: E402


@dataclass
class BenchArgs:
    cleanrl: str
    """a clone of CleanRL at fe8d8a0 (its cleanrl/ppo.py is run)"""
    python: str
    """the Python of CleanRL's own virtualenv (gymnasium 0.29.1)"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds, each run once per row, one after the other"""


def scalars(run_dir: str, tag: str) -> list:
    """The TensorBoard events of `tag` in `run_dir`: (wall_time, step, value) in order."""
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return [(e.wall_time, e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def cleanrl_run(bench: BenchArgs, seed: int, one_thread: bool) -> dict:
    """CleanRL's ppo.py on CartPole-v1 as it is, in a scratch folder; when its last 100 episodes first averaged 475."""
    env = os.environ | ({"OMP_NUM_THREADS": "1"} if one_thread else {})
    with tempfile.TemporaryDirectory() as cwd:
        launch = time.time()
        command = [bench.python, os.path.join(bench.cleanrl, "cleanrl", "ppo.py"), "--seed", str(seed)]
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"error: CleanRL's ppo.py failed:\n{done.stderr[-3000:]}")
        (run,) = [os.path.join(cwd, "runs", d) for d in os.listdir(os.path.join(cwd, "runs"))]
        returns, sps = scalars(run, "charts/episodic_return"), scalars(run, "charts/SPS")
    if not returns:
        sys.exit("error: CleanRL logged no episodic return: run it under gymnasium 0.29.1 (see the docstring)")
    window = deque(maxlen=100)
    for wall, step, value in returns:
        window.append(value)
        if len(window) == 100 and statistics.fmean(window) >= 475:
            # its charts/SPS is global_step / seconds since its training began: the training seconds to this step
            rate = next(v for _, s, v in sps if s >= step)
            return dict(launch=wall - launch, train=step / rate, sps=sps[-1][2], steps=step)
    return dict(launch=None, train=None, sps=sps[-1][2], steps=None)


def our_run(seed: int) -> dict:
    """`python ppo_cartpole_gpu.py --seed S` (its defaults), in a scratch folder."""
    with tempfile.TemporaryDirectory() as cwd:
        launch = time.time()
        script = os.path.join(os.path.dirname(HERE), "ppo_cartpole_gpu.py")
        done = subprocess.run([sys.executable, script, "--seed", str(seed)], cwd=cwd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"error: ppo_cartpole_gpu.py failed:\n{done.stderr[-3000:]}")
        (run,) = [os.path.join(cwd, "runs", d) for d in os.listdir(os.path.join(cwd, "runs"))]
        with open(os.path.join(run, "summary.json")) as f:
            summary = json.load(f)
        step = summary["solved_at_step"]
        wall = next((w for w, s, _ in scalars(run, "charts/SPS") if s >= step), None) if step else None
    return dict(launch=wall and wall - launch, train=summary["solved_at_seconds"], sps=summary["mean_sps"], steps=step)


def main() -> None:
    bench = tyro.cli(BenchArgs)
    rows = {"CleanRL ppo.py, torch's default threads": [], "CleanRL ppo.py, OMP_NUM_THREADS=1": [],
            "ppo_cartpole_gpu.py (defaults)": []}  # fmt: skip
    for seed in bench.seeds:
        for name, runs in rows.items():
            runs.append(our_run(seed) if name.startswith("ppo") else cleanrl_run(bench, seed, "OMP" in name))
            print(f"seed {seed}, {name}: {runs[-1]}", file=sys.stderr)
    shown = lambda xs, f: f"{f(statistics.median(xs))} ({f(min(xs))}–{f(max(xs))})" if None not in xs else "not all"
    seconds, count = (lambda x: f"{x:.2f}"), (lambda x: f"{x:,.0f}")
    print(f"`python benchmarks/cleanrl_real.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print(f"\n{machine()}; CleanRL at fe8d8a0; seeds {', '.join(map(str, bench.seeds))}: median (min–max)\n")
    print("| run | launch to 475, s | training to 475, s | SPS | env steps to 475 |")
    print("|---|---|---|---|---|")
    for name, runs in rows.items():
        cells = [shown([r[k] for r in runs], seconds if k in ("launch", "train") else count) for k in runs[0]]
        print(f"| {name} | {' | '.join(cells)} |")
    ours = rows["ppo_cartpole_gpu.py (defaults)"]
    median = lambda runs, key: statistics.median(r[key] for r in runs)
    for name, runs in list(rows.items())[:2]:
        ratios = {key: median(runs, key) / median(ours, key) for key in runs[0]}
        print(f"\n{name} / ppo_cartpole_gpu.py, medians: launch to 475 {ratios['launch']:.1f}x, training to 475 "
              f"{ratios['train']:.1f}x, env steps to 475 {ratios['steps']:.2f}x; SPS ours / theirs "
              f"{1 / ratios['sps']:.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
