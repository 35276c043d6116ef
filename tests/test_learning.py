"""CartPole is actually solved by the default arguments (seeded, CPU)."""

import glob
import json

import pytest

import ppo_cartpole_gpu as P


@pytest.mark.learning
@pytest.mark.parametrize("seed", [1, 2])
def test_defaults_solve_cartpole(seed, in_tmp):
    args = P.Args(seed=seed, device="cpu", progress_bar=False, total_timesteps=1_000_000)
    P.train(args)
    summary = json.load(open(glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))[0]))
    assert summary["status"] == "target return reached"
    assert summary["mean_return_last_100"] >= 475
    assert summary["solved_at_step"] is not None and summary["solved_at_step"] <= 400_000
    assert summary["eval_mean_return"] >= 475  # the greedy policy balances too


@pytest.mark.learning
def test_4096_envs_solve_cartpole(in_tmp):
    args = P.Args(seed=1, device="cpu", progress_bar=False, num_envs=4096)
    P.train(args)
    summary = json.load(open(glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))[0]))
    assert summary["status"] == "target return reached" and summary["solved_at_step"] <= 4_000_000
