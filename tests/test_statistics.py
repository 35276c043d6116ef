"""benchmarks/seeds.py: the aggregate across seeds (IQM, stratified bootstrap CI, steps to solve) against hand
computations and a plain loop, and its command line on real run folders."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_script

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import seeds  # noqa: E402

from ladder.sweep import table  # noqa: E402


def summary(seed, reached, step, evaluation, env_id="CartPole-v1"):
    return {"seed": seed, "env_id": env_id, "status": "target return reached" if reached else "completed",
            "solved_at_step": step, "eval_mean_return": evaluation}  # fmt: skip


@pytest.mark.quick
def test_iqm_is_the_mean_of_the_middle_half():
    assert seeds.iqm(np.array([7.0, 0, 1, 2, 3, 4, 5, 6])) == 3.5  # drops 0, 1 and 6, 7
    assert seeds.iqm(np.array([100.0, 1, 2, 3, 4, 5, 6, 7, 8, -100])) == 4.5  # n=10: drops 2 each end, keeps 1..8
    assert seeds.iqm(np.array([1.0, 2, 9])) == 4.0  # n < 4: nothing dropped
    rows = np.array([[0.0, 1, 2, 3], [4, 4, 4, 40]])
    assert seeds.iqm(rows, axis=1).tolist() == [1.5, 4.0]


@pytest.mark.quick
def test_the_bootstrap_resamples_within_each_env_as_a_plain_loop_does():
    scores = {"a": np.array([1.0, 2, 3, 4, 10]), "b": np.array([20.0, 30, 40])}
    reps, rng = 500, np.random.default_rng(7)
    # each env's runs drawn from that env alone (the same draws, in the same order), then pooled
    a = rng.integers(0, 5, size=(reps, 5))
    b = rng.integers(0, 3, size=(reps, 3))
    iqms = []
    for i in range(reps):  # the reference: one resample at a time
        pooled = sorted(list(scores["a"][a[i]]) + list(scores["b"][b[i]]))
        iqms.append(np.mean(pooled[2:6]))  # 8 scores: drop 2 each end
    low, high = seeds.stratified_bootstrap_ci(scores, reps, seed=7)
    assert (low, high) == pytest.approx(tuple(np.percentile(iqms, [2.5, 97.5])))
    assert low < seeds.iqm(np.concatenate(list(scores.values()))) < high
    assert seeds.stratified_bootstrap_ci({"a": np.full(6, 500.0)}, 100, 0) == (500.0, 500.0)


@pytest.mark.quick
def test_the_aggregate_counts_solves_and_takes_quartiles_by_hand():
    runs = [summary(1, True, 100, 500.0), summary(2, True, 300, 490.0), summary(3, False, 200, 310.0),
            summary(4, False, None, 120.0), summary(5, True, 400, 500.0)]  # fmt: skip
    agg = seeds.aggregate(runs, reps=200)
    # seed 3 passed 475 on the training episodes (solved_at_step) but never confirmed the target
    assert agg["runs"] == 5 and agg["target_reached"] == 3 and agg["solved"] == 4 and agg["seeds"] == [1, 2, 3, 4, 5]
    assert agg["solved_at_step_median"] == 250 and agg["solved_at_step_iqr"] == [175, 325]  # of 100, 200, 300, 400
    assert agg["eval_iqm"] == pytest.approx((310 + 490 + 500) / 3)  # n=5: drops 120 and one 500
    low, high = agg["eval_iqm_ci95"]
    assert 120 <= low <= agg["eval_iqm"] <= high <= 500
    assert seeds.line(agg).startswith("3/5 reached the target; solved at step median 250 (IQR 175–325) of 4; eval IQM")
    none = seeds.aggregate([summary(1, False, None, None)])
    assert none["eval_iqm"] is None and seeds.line(none) == "0/1 reached the target; none solved; no evaluation"


@pytest.mark.quick
def test_an_env_with_no_solved_level_is_not_counted_as_never_solved():
    """Atari's and Brax's envs have no solved level (summary.json's solved_threshold null): the aggregate's `solved` is
    None, its line says so and a --sweep's table shows "-". Before: "none solved" and 0% for every run (a user's
    trial of a Brax sweep)."""
    runs = [summary(seed, False, None, 100.0 * seed, env_id="hopper") | {"solved_threshold": None} for seed in (1, 2)]
    agg = seeds.aggregate(runs, reps=100)
    assert agg["solved"] is None and "; no solved level; eval IQM" in seeds.line(agg)
    row = dict(config="gamma=0.9", eval_iqm=1.0, ci95_low=0.5, ci95_high=1.5, solved=None, solved_at_step_median=None)
    assert table([row]).splitlines()[1].split()[-2:] == ["-", "-"]
    cartpole = seeds.aggregate([summary(1, False, None, 9.0) | {"solved_threshold": 475.0}], reps=100)
    assert cartpole["solved"] == 0 and "; none solved; " in seeds.line(cartpole)


def test_the_command_aggregates_real_run_folders(tmp_path):
    for seed in (1, 2):
        result = run_script("ppo_cartpole_gpu", "--seed", str(seed), "--total-timesteps", "4096", "--num-envs", "64",
                            "--eval-episodes", "4", "--no-progress-bar", "--device", "cpu", cwd=tmp_path)  # fmt: skip
        assert result.returncode == 0, result.stderr
    runs = sorted(str(p) for p in (tmp_path / "runs").iterdir())
    out = tmp_path / "aggregate.json"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "seeds.py"), *runs, "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("0/2 reached the target; none solved; eval IQM")
    agg = json.loads(out.read_text())
    assert agg["seeds"] == [1, 2] and agg["evaluated"] == 2
    bad = subprocess.run(command[:2] + [str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith(f"error: {tmp_path}: no summary.json")


@pytest.mark.quick
def test_the_permutation_test_of_many_seeds_matches_exact_enumeration():
    """benchmarks/many_seeds.py --statistics: the rank-sum permutation p-value against every split of small samples
    (ties and never-solved runs, at inf, included), within the Monte Carlo error of 100,000 shuffles."""
    import itertools

    pytest.importorskip("jax", reason="many_seeds.py holds the JAX peer: pip install -r requirements-brax.txt")
    import many_seeds

    for a, b in [([1.0, 2, 3, 4], [5.0, 6, 7, 8]), ([1.0, 5, 3, 7], [2.0, 6, 4, 8]),
                 ([1.0, 2, np.inf, 4], [np.inf, np.inf, 3, 3])]:  # fmt: skip
        x = np.array(a + b)
        ranks = np.array([(x < v).sum() + ((x == v).sum() + 1) / 2 for v in x])  # mean ranks of ties
        gaps = [abs(ranks[list(left)].mean() - np.delete(ranks, list(left)).mean())
                for left in itertools.combinations(range(len(x)), len(a))]  # fmt: skip
        exact = np.mean([g >= gaps[0] - 1e-12 for g in gaps])  # the first split: a itself
        assert many_seeds.rank_sum_p(np.array(a), np.array(b)) == pytest.approx(exact, abs=0.01)
