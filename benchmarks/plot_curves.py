"""Learning curves (episodic return vs env steps) from TensorBoard logs.

    python benchmarks/cartpole.py                 # writes the logs to benchmarks/logs/runs
    python benchmarks/plot_curves.py              # -> benchmarks/logs/cartpole_learning_curves.png
    python benchmarks/plot_curves.py --out docs/cartpole_learning_curves.png   # replace README's figure
    python benchmarks/plot_curves.py --runs benchmarks/logs/atari/runs --exp-names ppo_atari_envpool \
        --hline None --no-log-x --title "Breakout-v5" --out benchmarks/logs/atari_breakout.png

Each run folder is named {env_id}__{exp_name}__{seed}__{time}; runs are grouped by exp_name, one
colour per algorithm, one line per seed.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import tyro  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


@dataclass
class PlotArgs:
    runs: str = "benchmarks/logs/runs"
    """folder of run folders with TensorBoard events"""
    exp_names: list[str] = field(default_factory=lambda: ["reinforce", "vpg", "ppo_cartpole_gpu"])
    """the experiments to draw, in legend order"""
    tag: str = "charts/episodic_return"
    """the scalar to draw"""
    out: str = "benchmarks/logs/cartpole_learning_curves.png"
    """the PNG to write (README's figures live in docs/: write there on purpose only)"""
    title: str = "CartPole-v1, default arguments, CPU (runs stop at a 100-episode mean of 500)"
    """the plot's title (the seeds are appended)"""
    hline: Optional[float] = 475.0
    """a dashed reference line (None: none)"""
    log_x: bool = True
    """log-scale the env-step axis"""


def load_curves(runs: str, tag: str) -> dict[str, list[tuple[int, list[int], list[float]]]]:
    """{exp_name: [(seed, steps, values), ...]} for every run folder under `runs` that logged `tag`."""
    curves: dict[str, list] = {}
    for run in sorted(glob.glob(os.path.join(runs, "*"))):
        parts = os.path.basename(run).split("__")
        if len(parts) != 4:
            continue
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        if tag not in acc.Tags()["scalars"]:
            continue
        events = acc.Scalars(tag)
        curves.setdefault(parts[1], []).append((int(parts[2]), [e.step for e in events], [e.value for e in events]))
    return curves


def main() -> None:
    args = tyro.cli(PlotArgs)
    curves = load_curves(args.runs, args.tag)
    missing = [name for name in args.exp_names if name not in curves]
    if missing:
        raise SystemExit(f"error: no runs of {', '.join(missing)} with {args.tag} under {args.runs}")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for colour, name in zip(("tab:orange", "tab:green", "tab:blue", "tab:red", "tab:purple"), args.exp_names):
        for i, (_seed, steps, values) in enumerate(sorted(curves[name])):
            ax.plot(steps, values, color=colour, alpha=0.8, lw=1.2, label=f"{name}.py" if i == 0 else None)
    if args.hline is not None:
        ax.axhline(args.hline, color="grey", ls="--", lw=0.8)
    if args.log_x:
        ax.set_xscale("log")
    ax.set_xlabel("env steps (log scale)" if args.log_x else "env steps")
    ax.set_ylabel("episodic return (iteration mean)")
    seeds = sorted({seed for name in args.exp_names for seed, _, _ in curves[name]})
    ax.set_title(f"{args.title}; seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}")
    ax.title.set_fontsize(9)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
