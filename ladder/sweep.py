"""--sweep NAME=V1,V2,...: the grid of configurations (each run with --num-seeds K seeds, all stacked), and at the end
the configurations ranked by their seeds' evaluations: a table printed and saved (CSV, JSON), their learning curves."""

import csv
import difflib
import itertools
import os
from dataclasses import fields

import numpy as np

from ladder.checkpoint import write_atomically
from ladder.flags import RUN_FLAGS, UsageError
from ladder.statistics import aggregate

WHY_NOT = {"int": "an int flag sets shapes or counts", "bool": "a bool flag picks a branch of the code in Python"}
WHY_NOT["seed"] = "seeds are --num-seeds K's (--seed to --seed + K - 1)"


def sweep_grid(args) -> list[dict]:
    """Every configuration of `args.sweep` ({flag: value}, the grid of the flags' values; `Args`' own rules check each
    when seeds_flags makes its runs' flags)."""
    kinds = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in fields(args)}
    axes = {}
    for spec in args.sweep:
        flag, equals, values = spec.partition("=")
        name = flag.removeprefix("--").replace("-", "_")
        if not equals or not values:
            raise UsageError(f"--sweep {spec}: write NAME=V1,V2,... (e.g. --sweep learning-rate=1e-3,3e-3)")
        if name not in kinds or name in RUN_FLAGS:
            algorithm = [n.replace("_", "-") for n in kinds if n not in RUN_FLAGS]
            meant = difflib.get_close_matches(name.replace("_", "-"), algorithm, n=1)
            what = "a run's flag, not the algorithm's" if name in RUN_FLAGS else "no such flag of the algorithm"
            raise UsageError(f"--sweep {flag}: {what}" + (f"; did you mean {meant[0]}?" if meant else ""))
        if kinds[name] != "float" or name in axes:
            kind = WHY_NOT.get(name, WHY_NOT.get(kinds[name], f"its type, {kinds[name]}, is not a float"))
            why = "given twice" if name in axes else kind
            raise UsageError(f"--sweep {flag}: {why}; only the algorithm's float flags are swept, each once")
        try:
            axes[name] = [float(value) for value in values.split(",")]
        except ValueError as e:
            raise UsageError(f"--sweep {flag}: {str(e).split(': ')[-1]} is not a number") from None
        if len(set(axes[name])) < len(axes[name]):  # (a typo: two runs of one configuration, under one name)
            raise UsageError(f"--sweep {flag}: a value is given twice")
        if getattr(args, name) != next(f.default for f in fields(args) if f.name == name):  # the sweep would drop it
            given = f"--{name.replace('_', '-')} {getattr(args, name)}"
            raise UsageError(f"--sweep {flag}: {given} is given too; the sweep sets it (leave one out)")
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def config_name(config: dict) -> str:
    return ",".join(f"{name.replace('_', '-')}={value:g}" for name, value in config.items())


def write_ranking(folder: str, grid: list[dict], dirs: list[str], summaries: list[dict]) -> list[dict]:
    """ranking.csv, ranking.json and learning_curves.png in `folder`: a row per configuration (its seeds' runs
    consecutive in `dirs`), ranked by the IQM of their final evaluations, with its 95% bootstrap CI."""
    k, rows = len(summaries) // len(grid), []
    for i, config in enumerate(grid):
        agg = aggregate(summaries[i * k : (i + 1) * k])
        low, high = agg["eval_iqm_ci95"] or (None, None)
        row = dict(config=config_name(config), **config, eval_iqm=agg["eval_iqm"], ci95_low=low, ci95_high=high)
        solved = agg["solved"] and agg["solved"] / agg["runs"]  # (None: the env has no solved level)
        rows.append(row | dict(solved=solved, solved_at_step_median=agg["solved_at_step_median"]))
    worst = lambda x, sign: np.inf if x is None else sign * x  # noqa: E731  (ties: more solved, then sooner)
    rows.sort(key=lambda r: (worst(r["eval_iqm"], -1), -(r["solved"] or 0), worst(r["solved_at_step_median"], 1)))
    write_atomically(os.path.join(folder, "ranking.json"), rows)
    with open(os.path.join(folder, "ranking.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    labels, curves = [config_name(config) for config in grid], [curve(run_dir) for run_dir in dirs]
    plot_curves(os.path.join(folder, "learning_curves.png"), labels, curves, k)
    return rows


def curve(run_dir: str) -> dict[int, float]:
    """The run's charts/episodic_return by env step, from its TensorBoard events (a resumed run's too)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    tag = "charts/episodic_return"
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def plot_curves(path: str, labels: list[str], curves: list[dict], k: int) -> None:
    """Each configuration's episodic return against steps: the median of its `k` seeds' curves, their IQR shaded."""
    import matplotlib  # (~0.5 s: imported by a sweep's end alone)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, name in enumerate(labels):
        seeds = curves[i * k : (i + 1) * k]
        if not (steps := sorted(set().union(*seeds))):  # (an iteration in which no episode of a seed ended: none)
            continue
        returns = np.array([[seed.get(step, np.nan) for step in steps] for seed in seeds]).reshape(k, len(steps))
        with np.errstate(all="ignore"):
            q1, median, q3 = np.nanpercentile(returns, [25, 50, 75], axis=0)
        ax.plot(steps, median, label=name)
        ax.fill_between(steps, q1, q3, alpha=0.2)
    ax.set(xlabel="env steps", ylabel="episodic return", title=f"median and interquartile range of {k} seeds")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def table(rows: list[dict]) -> str:
    lines = [
        f"{'rank':>4}  {'configuration':<40} {'eval IQM':>9}  {'95% CI':<15} {'solved':>6}  {'steps to solve':>14}"
    ]
    for i, row in enumerate(rows, 1):
        ci = "" if row["eval_iqm"] is None else f"{row['ci95_low']:.1f}–{row['ci95_high']:.1f}"
        iqm = "-" if row["eval_iqm"] is None else f"{row['eval_iqm']:.1f}"
        steps = "-" if row["solved_at_step_median"] is None else f"{row['solved_at_step_median']:,.0f}"
        solved = "-" if row["solved"] is None else f"{row['solved']:.0%}"
        lines.append(f"{i:>4}  {row['config']:<40} {iqm:>9}  {ci:<15} {solved:>6}  {steps:>14}")
    return "\n".join(lines)
