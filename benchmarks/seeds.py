"""Across seeds: the aggregate rliable (Agarwal et al. 2021) asks for, from the run folders of K runs.

    for seed in 1 2 3 4 5 6 7 8; do python ppo_cartpole_gpu.py --seed $seed; done
    python benchmarks/seeds.py runs/CartPole-v1__ppo_cartpole_gpu__*      # one line; --out writes aggregate.json

Reads each folder's summary.json (any of the five scripts: they share its schema) and prints how many runs reached
their target, the median and interquartile range of the steps to solve (of those that solved), and the
interquartile mean (IQM) of the final evaluation returns with a 95% stratified bootstrap confidence interval:
the runs are resampled with replacement within each env (the strata), the IQM recomputed, and the 2.5th and
97.5th percentiles of 10,000 such IQMs kept (rliable's percentile interval). numpy alone: rliable itself would
bring pandas, statsmodels, arch and seaborn. The code is the tensor scripts' own (`--num-seeds K` prints the same
aggregate); an aggregate folder of `--num-seeds` among the folders is skipped (its seeds' folders are there too).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ladder.statistics import aggregate, iqm, line, stratified_bootstrap_ci  # noqa: E402, F401 (the scripts' own code)


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


def main() -> None:
    args = tyro.cli(SeedsArgs)
    summaries = []
    for run in args.runs:
        path = os.path.join(run, "summary.json")
        if not os.path.isfile(path):
            print(f"error: {run}: no summary.json (not a run folder, or the run is still going)", file=sys.stderr)
            raise SystemExit(2)
        with open(path) as f:
            summary = json.load(f)
        if "run_dirs" not in summary:  # not a --num-seeds aggregate
            summaries.append(summary)
    agg = aggregate(summaries, args.reps, args.seed)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(agg, f, indent=2)
    print(line(agg))


if __name__ == "__main__":
    main()
