"""Across seeds: the aggregate rliable (Agarwal et al. 2021) asks for, from the run folders of K runs.

    for seed in 1 2 3 4 5 6 7 8; do python ppo_cartpole_gpu.py --seed $seed; done
    python benchmarks/seeds.py runs/CartPole-v1__ppo_cartpole_gpu__*      # one line; --out writes aggregate.json

Reads each folder's summary.json (any of the five scripts: they share its schema) and prints how many runs reached
their target, the median and interquartile range of the steps to solve (of those that solved), and the
interquartile mean (IQM) of the final evaluation returns with a 95% stratified bootstrap confidence interval:
the runs are resampled with replacement within each env (the strata), the IQM recomputed, and the 2.5th and
97.5th percentiles of 10,000 such IQMs kept (rliable's percentile interval). numpy alone: rliable itself would
bring pandas, statsmodels, arch and seaborn.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import tyro


@dataclass
class SeedsArgs:
    runs: tyro.conf.Positional[list[str]]
    """run folders (each with a summary.json), e.g. runs/CartPole-v1__ppo_cartpole_gpu__*"""
    reps: int = 10_000
    """bootstrap resamples"""
    seed: int = 0
    """seed of the bootstrap's random numbers"""
    out: Optional[str] = None
    """also write the aggregate as JSON there"""


def iqm(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    """Interquartile mean: the mean of the middle half, after dropping floor(n/4) scores from each end (as
    scipy.stats.trim_mean(scores, 0.25), which rliable uses)."""
    n = scores.shape[axis]
    cut = n // 4
    return np.sort(scores, axis=axis).take(range(cut, n - cut), axis=axis).mean(axis=axis)


def stratified_bootstrap_ci(scores: dict[str, np.ndarray], reps: int, seed: int, level: float = 0.95):
    """The percentile interval of the IQM over `reps` resamples, each drawing every stratum's (env's) runs with
    replacement from that stratum alone and pooling them."""
    rng = np.random.default_rng(seed)
    pooled = [runs[rng.integers(0, len(runs), size=(reps, len(runs)))] for runs in scores.values()]
    samples = iqm(np.concatenate(pooled, axis=1), axis=1)
    return tuple(np.percentile(samples, [100 * (1 - level) / 2, 100 * (1 + level) / 2]))


def aggregate(summaries: list[dict], reps: int = 10_000, seed: int = 0) -> dict:
    """The aggregate of the runs' summaries (see the module's docstring); None where no run gives the number."""
    reached = [s for s in summaries if s["status"] == "target return reached"]
    steps = np.array([s["solved_at_step"] for s in summaries if s["solved_at_step"] is not None], dtype=float)
    scores: dict[str, list[float]] = {}
    for s in summaries:
        if s["eval_mean_return"] is not None:
            scores.setdefault(s["env_id"], []).append(s["eval_mean_return"])
    evals = {env: np.array(v) for env, v in scores.items()}
    agg = {"runs": len(summaries), "seeds": sorted(s["seed"] for s in summaries), "target_reached": len(reached),
           "solved": len(steps), "solved_at_step_median": None, "solved_at_step_iqr": None,
           "evaluated": sum(map(len, evals.values())), "eval_iqm": None, "eval_iqm_ci95": None}  # fmt: skip
    if len(steps):
        q1, median, q3 = np.percentile(steps, [25, 50, 75]).tolist()
        agg.update(solved_at_step_median=median, solved_at_step_iqr=[q1, q3])
    if evals:
        ci = [float(x) for x in stratified_bootstrap_ci(evals, reps, seed)]
        agg.update(eval_iqm=float(iqm(np.concatenate(list(evals.values())))), eval_iqm_ci95=ci)
    return agg


def line(agg: dict) -> str:
    """The one-line result."""
    steps = "none solved"
    if agg["solved"]:
        q1, q3 = agg["solved_at_step_iqr"]
        steps = (
            f"solved at step median {agg['solved_at_step_median']:,.0f} (IQR {q1:,.0f}–{q3:,.0f}) of {agg['solved']}"
        )
    evals = "no evaluation"
    if agg["eval_iqm"] is not None:
        low, high = agg["eval_iqm_ci95"]
        evals = f"eval IQM {agg['eval_iqm']:.1f} (95% CI {low:.1f}–{high:.1f}, {agg['evaluated']} runs)"
    return f"{agg['target_reached']}/{agg['runs']} reached the target; {steps}; {evals}"


def main() -> None:
    args = tyro.cli(SeedsArgs)
    summaries = []
    for run in args.runs:
        path = os.path.join(run, "summary.json")
        if not os.path.isfile(path):
            print(f"error: {run}: no summary.json (not a run folder, or the run is still going)", file=sys.stderr)
            raise SystemExit(2)
        with open(path) as f:
            summaries.append(json.load(f))
    agg = aggregate(summaries, args.reps, args.seed)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(agg, f, indent=2)
    print(line(agg))


if __name__ == "__main__":
    main()
