"""--num-seeds K: the seeds of one process, each its own run (envs, weights, optimizer, clipping, advantage
normalisation, minibatch order), stacked into one vmapped call; resumed, stopped, evaluated and filmed like one run."""

import glob
import itertools
import os
import re
import signal
import sys
import time
from dataclasses import replace

import pytest
import torch

from conftest import (
    ROOT,
    SCRIPTS,
    assert_one_error_line,
    assert_same_agents,
    call_main,
    fake_wandb,
    import_script,
    interrupt_after_an_iteration,
    read_json,
    run_script,
    scalars,
    small_args,
    stop_with_sigterm_at,
    train_seeds,
)
from ladder.flags import UsageError
from ladder.optim import Adam
from ladder.stacked import Stacked
from test_compile import recompilations


def folders(tmp, exp_name: str) -> tuple[str, list[str]]:
    """The aggregate folder of `exp_name`'s seeds, and their run folders in seed order (from the aggregate)."""
    (group,) = glob.glob(os.path.join(str(tmp), "runs", f"*__{exp_name}__*-*__*"))
    return group, [os.path.join(str(tmp), d) for d in read_json(os.path.join(group, "summary.json"))["run_dirs"]]


def stacked_stopped_and_resumed(module, args, tmp, monkeypatch):
    """K stacked seeds trained straight through ("whole") and stopped by SIGTERM after iteration 3 ("cut"), then
    resumed from their aggregate folder; asserts each seed's scalars and weights are the straight run's and returns
    (whole's agents, the resumed agents, the stopped seeds' summaries)."""
    whole = train_seeds(module, replace(args, exp_name="whole"))
    stop_with_sigterm_at(module, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train_seeds(module, replace(args, exp_name="cut"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # Seeds put the handlers back
    group, dirs = folders(tmp, "cut")
    stopped = [read_json(os.path.join(d, "summary.json")) for d in dirs]
    resumed = train_seeds(module, replace(args, exp_name="cut", resume=group))
    for k, d in enumerate(folders(tmp, "whole")[1]):
        assert scalars(dirs[k]) == scalars(d), f"seed {k + 1}"
        for (name, a), b in zip(whole[k].state_dict().items(), resumed[k].state_dict().values()):
            assert torch.equal(a, b), f"seed {k + 1}: {name}"
    return whole, resumed, stopped


@pytest.mark.behaviour
@pytest.mark.parametrize("script", SCRIPTS)
def test_two_seeds_in_one_process_are_two_runs_and_their_aggregate(script, in_tmp, monkeypatch):
    """Two run folders and an aggregate beside them, all three named with the run's start time (a clock that ticks a
    second each time it is read: before, each seed's folder had the time its envs were built); the seeds' curves and
    weights differ. (Their noise is drawn for both in one call, so a seed's stream is not the one it has alone:
    benchmarks/many_seeds.py --statistics checks that stacked seeds learn as separate runs do.)"""
    module = import_script(script)
    args = small_args(module, num_seeds=2, exp_name="two")
    ticks = itertools.count(1_700_000_000)
    monkeypatch.setattr(time, "time", lambda: next(ticks))
    agents = train_seeds(module, args)
    group, dirs = folders(in_tmp, "two")
    assert len(agents) == 2 and os.path.basename(group).split("__")[2] == "1-2"
    assert len({os.path.basename(folder).split("__")[-1] for folder in [group, *dirs]}) == 1, [group, *dirs]
    runs = [read_json(os.path.join(d, "summary.json")) for d in dirs]
    assert [s["seed"] for s in runs] == [1, 2] and all(s["status"] == "completed" for s in runs)
    assert [s["args"]["num_seeds"] for s in runs] == [1, 1]  # each folder resumes alone as one seed
    agg = read_json(os.path.join(group, "summary.json"))
    assert agg["runs"] == 2 and agg["seeds"] == [1, 2] and agg["evaluated"] == 2 and agg["args"]["num_seeds"] == 2
    curves = [scalars(d) for d in dirs]
    assert curves[0]["charts/episodic_return"] != curves[1]["charts/episodic_return"]
    assert not any(torch.equal(a, b) for a, b in zip(agents[0].parameters(), agents[1].parameters()))


def test_each_seed_clips_and_normalises_with_its_own_data():
    """One stacked PPO gradient step of two seeds (the script's `gradient_step`, vmapped): changing seed 2's minibatch
    (advantages 1000x, so its gradient is clipped and its normalisation differs) leaves seed 1's update exactly as it
    was, and seed 1's update is the one it takes alone within float tolerance."""
    P = import_script("ppo_cartpole_gpu")
    args = small_args(P, num_seeds=2)

    def update(scale: float):
        torch.manual_seed(0)
        agents = [P.Agent(4, 2) for _ in range(2)]
        optimizers = [Adam(a, lr=1e-2, eps=1e-5) for a in agents]
        g = torch.Generator().manual_seed(1)
        batches = [P.Batch(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g),
                           -torch.rand(64, generator=g), torch.randn(64, generator=g), torch.randn(64, generator=g),
                           torch.randn(64, generator=g)) for _ in range(2)]  # fmt: skip
        batches[1] = batches[1]._replace(advantages=batches[1].advantages * scale)
        stack = Stacked([{"agent": a, "optimizer": o} for a, o in zip(agents, optimizers)])
        step = lambda batch: P.gradient_step(agents[1], optimizers[1], P.ppo_loss, args, batch)  # the lead's objects
        stats = stack.call(step, P.Batch(*map(torch.stack, zip(*batches))))
        stack.release()
        return agents[0], {tag: value.unbind() for tag, value in stats.items()}, batches[0]

    one, stats, batch = update(1.0)
    same, stats_scaled, _ = update(1000.0)
    for a, b in zip(one.parameters(), same.parameters()):
        assert torch.equal(a, b)
    assert stats["losses/policy_loss"][0] == stats_scaled["losses/policy_loss"][0]
    assert stats["losses/policy_loss"][1] != stats_scaled["losses/policy_loss"][1]
    torch.manual_seed(0)
    alone = P.Agent(4, 2)
    P.gradient_step(alone, Adam(alone, lr=1e-2, eps=1e-5), P.ppo_loss, args, batch)
    for a, b in zip(one.parameters(), alone.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.behaviour
@pytest.mark.parametrize("script", SCRIPTS)
def test_two_seeds_stopped_and_resumed_equal_one_run(script, in_tmp, monkeypatch):
    """Two stacked seeds stopped by SIGTERM (after the same stacked call, with checkpoints) and resumed from their
    aggregate folder: each seed's scalars and weights are those of the two trained straight through."""
    module = import_script(script)
    _, _, stopped = stacked_stopped_and_resumed(module, small_args(module, num_seeds=2), in_tmp, monkeypatch)
    assert [s["status"] for s in stopped] == ["interrupted"] * 2
    if script != "reinforce":  # its seeds' rollouts take different numbers of chunks: not in step by iteration
        assert stopped[0]["iterations"] == stopped[1]["iterations"]


def test_compiled_seeds_train_as_eager_ones_in_one_graph_and_resume_exactly(in_tmp, monkeypatch):
    """--compile with --num-seeds 2: the stacked iteration compiled whole (torch.compile cannot run inside vmap; the
    script's compiled phases join its graph) trains each seed as the eager stacked call does within float tolerance,
    in one graph compiled once (before: the observations' layout and the first call's tensors, guarded, compiled it
    again at iteration 2), and stopped by SIGTERM and resumed it ends as straight through, bit for bit."""
    P = import_script("ppo_cartpole_gpu")
    tiny = dict(num_envs=8, num_steps=4, num_minibatches=1, update_epochs=2, total_timesteps=8 * 4 * 8)
    args = small_args(P, num_seeds=2, eval_episodes=0, **tiny)
    eager = train_seeds(P, replace(args, exp_name="eager"))
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled, _, _ = stacked_stopped_and_resumed(P, replace(args, compile=True), in_tmp, monkeypatch)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    assert graphs == 3, recompilations()  # whole, cut and resumed: once each
    for k in range(2):
        assert_same_agents(compiled[k], eager[k], "compiled", atol=2e-4, rtol=1e-3)  # seed k + 1


@pytest.mark.slow  # ~1.5 min of compiling; PPO's test above runs the machinery they share in CI
@pytest.mark.parametrize("script", ["vpg", "ppo_mujoco_brax"])
def test_compiled_seeds_of_vpg_and_brax_train_as_eager_ones(script, in_tmp):
    """VPG's stacked iteration and Brax's stacked update (its envs step in JAX seed by seed, outside the graph),
    compiled with two seeds: each seed's weights as the eager stacked call's, within float tolerance."""
    module = import_script(script)
    flags = dict(num_envs=8, num_steps=8, total_timesteps=8 * 8 * 6, eval_episodes=0)
    if script == "ppo_mujoco_brax":
        flags |= dict(env_id="inverted_pendulum", num_minibatches=1, update_epochs=2, total_timesteps=8 * 8 * 5)
    args = small_args(module, num_seeds=2, **flags)
    eager = train_seeds(module, replace(args, exp_name="eager"))
    torch._dynamo.reset()
    compiled = train_seeds(module, replace(args, exp_name="compiled", compile=True))
    for k in range(2):
        assert_same_agents(compiled[k], eager[k], "compiled", atol=2e-4, rtol=1e-3)  # seed k + 1


def test_sigterm_stops_every_seed_with_a_checkpoint_and_says_how_to_resume(tmp_path):
    flags = ["--num-seeds", "2", "--num-envs", "32", "--total-timesteps", "100000000", "--target-return", "None",
             "--checkpoint-interval", "0", "--no-progress-bar"]  # fmt: skip
    result = interrupt_after_an_iteration([sys.executable, os.path.join(ROOT, "ppo_cartpole_gpu.py"), *flags],
                                          tmp_path, signal.SIGTERM)  # fmt: skip
    assert result.returncode == 143 and "Traceback" not in result.stderr, result.stderr
    group, dirs = folders(tmp_path, "ppo_cartpole_gpu")
    command = f"python {os.path.join(ROOT, 'ppo_cartpole_gpu.py')} --resume {os.path.relpath(group, tmp_path)}"
    assert result.stderr.splitlines()[-1] == f"interrupted by SIGTERM, with a checkpoint; go on with: {command}"
    counters = [torch.load(os.path.join(d, "checkpoint.pt"), weights_only=True)["counters"] for d in dirs]
    assert counters[0]["iteration"] == counters[1]["iteration"] > 0


@pytest.mark.behaviour
@pytest.mark.parametrize("script", SCRIPTS)
def test_two_seeds_save_evaluate_and_film_like_one(script, in_tmp, capsys):
    """--save-model: a model in each seed's folder; --capture-video: seed 1's envs filmed; --eval-only --load-model of
    the aggregate folder evaluates each seed's own weights, as its training's final evaluation did, and its line says
    their evaluation alone (it said "0/2 reached the target; none solved", as if they had trained: a user's trial), as
    the aggregate's summary.json does (it held `"solved": 0, "target_reached": 0`: another trial)."""
    module = import_script(script)
    args = small_args(module, num_seeds=2, save_model=True, capture_video=True, video_interval=0, exp_name="train")
    train_seeds(module, args)
    group, dirs = folders(in_tmp, "train")
    assert [os.listdir(os.path.join(d, "videos")) if os.path.isdir(os.path.join(d, "videos")) else [] for d in dirs] \
        == [["evaluation.mp4"], []]  # fmt: skip
    trained = [read_json(os.path.join(d, "summary.json")) for d in dirs]
    assert all(os.path.isfile(s["model_path"]) for s in trained)
    train_seeds(module, replace(args, eval_only=True, load_model=group, save_model=False, capture_video=False,
                                exp_name="eval"))  # fmt: skip
    assert re.search(
        r"^2 seeds: eval IQM [\d.]+ \(95% CI [\d.]+–[\d.]+, 2 runs\); outputs in ", capsys.readouterr().out, re.M
    )
    eval_group, eval_dirs = folders(in_tmp, "eval")
    evaluated = [read_json(os.path.join(d, "summary.json")) for d in eval_dirs]
    assert [s["eval_returns"] for s in evaluated] == [s["eval_returns"] for s in trained]
    agg = read_json(os.path.join(eval_group, "summary.json"))
    assert agg["evaluated"] == 2 and agg["eval_iqm"] is not None and not {"solved", "target_reached"} & set(agg), agg


def test_tracked_seeds_are_a_wandb_run_each_in_one_group_and_resume_in_it(in_tmp, monkeypatch):
    """--track --num-seeds 2: one W&B run per seed, named as its folder, in the group of their aggregate folder; each
    run is given its own seed's scalars (TensorBoard's, at the same global steps), and --resume goes on in it."""
    runs = fake_wandb(monkeypatch)
    P = import_script("ppo_cartpole_gpu")
    args = small_args(P, num_seeds=2, track=True, exp_name="tracked")
    train_seeds(P, args)
    group, dirs = folders(in_tmp, "tracked")
    assert [run.settings["name"] for run in runs] == [os.path.basename(d) for d in dirs]
    assert [run.settings["group"] for run in runs] == [os.path.basename(group)] * 2
    assert all(run.finished and run.settings["reinit"] == "create_new" for run in runs)
    for run, d in zip(runs, dirs):
        logged, step = {}, None
        for row in run.rows:  # a row without global_step is at the last one (W&B's step_sync)
            step = row.get("global_step", step)
            for tag, value in row.items() if step is not None else ():
                logged.setdefault(tag, []).append((step, pytest.approx(value, rel=1e-6)))
        assert {tag: v for tag, v in logged.items() if tag not in ("global_step", "charts/SPS")} == scalars(d)
    train_seeds(P, replace(args, resume=group, total_timesteps=2 * args.total_timesteps))
    assert [run.settings["id"] for run in runs[2:]] == [run.id for run in runs[:2]]
    assert [run.settings["group"] for run in runs[2:]] == [os.path.basename(group)] * 2
    with pytest.raises(UsageError, match="each seed has ended; to train on, raise --total-timesteps"):
        train_seeds(P, replace(args, resume=group, total_timesteps=2 * args.total_timesteps))


@pytest.mark.parametrize("script, flags, message", [
    ("ppo_cartpole_gpu", ["--target-kl", "0.01"], "--num-seeds: vmap: It looks like you're attempting to use a "
                                                  "Tensor in some data-dependent control flow"),  # a branch per seed
    ("reinforce", ["--compile"], "--compile must be off with --num-seeds or --sweep here"),  # a graph per length
])  # fmt: skip
def test_what_cannot_be_stacked_is_refused_in_one_line(script, flags, message, in_tmp):
    result = call_main(script, "--num-seeds", "2", "--num-envs", "32", "--total-timesteps", "2048",
                       "--no-progress-bar", *flags, cwd=in_tmp)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert message in line, line


def test_a_resumed_seed_that_had_reached_the_target_is_evaluated_again_at_the_end(in_tmp, monkeypatch):
    """Seeds stopped when one had reached --target-return: resumed by the command the stop printed, the other trains
    on and that one is evaluated again at the end (its confirming returns are not in its checkpoint). Before: a
    TypeError in its final evaluation, which reused returns it did not have, and no aggregate."""
    P = import_script("ppo_cartpole_gpu")
    stop_with_sigterm_at(P, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train_seeds(P, small_args(P, num_seeds=2, exp_name="cut", target_return=1000.0, eval_episodes=2))
    monkeypatch.undo()
    group, dirs = folders(in_tmp, "cut")
    saved = torch.load(path := os.path.join(dirs[1], "checkpoint.pt"), weights_only=True)
    saved["counters"]["target_reached"] = True  # as if seed 2 had reached the target, confirmed, before the stop
    torch.save(saved, path)
    result = call_main("ppo_cartpole_gpu", "--resume", group, "--no-progress-bar", cwd=in_tmp)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    summaries = [read_json(os.path.join(d, "summary.json")) for d in dirs]
    assert [s["status"] for s in summaries] == ["completed", "target return reached"]
    assert [len(s["eval_returns"]) for s in summaries] == [2, 2] and "2 seeds: " in result.stdout


def test_a_run_that_reached_its_target_resumed_without_one_trains_on(in_tmp):
    """The refusal of a finished run says `pass --target-return None, or a higher one`: so resumed, it trains on to
    --total-timesteps. Before, the target it had reached still stopped it after one iteration, and its final
    evaluation raised a TypeError (and K seeds' checkpoints were left at different iterations)."""
    flags = ["--num-envs", "32", "--total-timesteps", "40960", "--eval-episodes", "2", "--no-progress-bar"]
    first = call_main("ppo_cartpole_gpu", *flags, "--target-return", "20", "--exp-name", "low", cwd=in_tmp)
    (folder,) = glob.glob(str(in_tmp / "runs" / "*__low__*"))
    assert read_json(os.path.join(folder, "summary.json"))["status"] == "target return reached", first.stdout
    result = call_main("ppo_cartpole_gpu", "--resume", folder, "--target-return", "None", cwd=in_tmp)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    summary = read_json(os.path.join(folder, "summary.json"))
    assert summary["status"] == "completed" and summary["total_env_steps"] == 40960, summary
    assert len(summary["eval_returns"]) == 2


def test_a_sweeps_aggregate_is_not_evaluated_as_seeds(in_tmp):
    """`--eval-only --load-model <a sweep's aggregate> --num-seeds 4`: refused in one line. Before, its four runs (two
    configurations) were evaluated as four seeds of one, their values gone from the names, and one IQM pooled. Without
    --num-seeds too: before, the first run was evaluated, its summary.json holding the command's flags, not its own
    (a user's trial)."""
    P = import_script("ppo_cartpole_gpu")
    train_seeds(P, small_args(P, sweep=("gamma=0.9,0.99",), num_seeds=2, exp_name="grid", eval_episodes=0))
    (group,) = glob.glob(str(in_tmp / "runs" / "*__grid__*-configurations__*"))
    for k in ("4", "1"):
        result = call_main("ppo_cartpole_gpu", "--eval-only", "--load-model", group, "--num-seeds", k, cwd=in_tmp)
        assert_one_error_line(result, f"--load-model {group}: a --sweep's aggregate; evaluate one of its run folders")


def test_a_single_seed_folder_is_not_resumed_as_k_seeds(in_tmp):
    P = import_script("ppo_cartpole_gpu")
    P.train(small_args(P, exp_name="one"))
    (one,) = glob.glob(str(in_tmp / "runs" / "*__one__*"))
    result = call_main("ppo_cartpole_gpu", "--resume", one, "--num-seeds", "2", "--total-timesteps", "9999",
                       cwd=in_tmp)  # fmt: skip
    assert_one_error_line(result, "--resume with --num-seeds 2 takes the aggregate folder of 2 seeds")


def test_an_aggregate_folder_is_not_resumed_as_one_run(in_tmp):
    """`--resume <aggregate> --num-seeds 1` is refused, the aggregate left as it was. Before, seed 1's checkpoint
    trained on into the aggregate folder, whose summary.json (its runs' list) it wrote over."""
    P = import_script("ppo_cartpole_gpu")
    train_seeds(P, small_args(P, num_seeds=2, exp_name="two"))
    group, _ = folders(in_tmp, "two")
    before = {f: os.path.getmtime(os.path.join(group, f)) for f in os.listdir(group)}
    result = call_main("ppo_cartpole_gpu", "--resume", group, "--num-seeds", "1", "--total-timesteps", "9999",
                       cwd=in_tmp)  # fmt: skip
    assert_one_error_line(result, f"--resume {group}: the aggregate of 2 runs, give --num-seeds 2")
    assert {f: os.path.getmtime(os.path.join(group, f)) for f in os.listdir(group)} == before


def test_a_folder_with_a_summary_but_no_checkpoint_is_refused_in_one_line(in_tmp):
    """An --eval-only run's folder has a summary.json, no checkpoint: not an aggregate of seeds, nothing to resume."""
    os.makedirs(folder := str(in_tmp / "runs" / "evaluated"))
    with open(os.path.join(folder, "summary.json"), "w") as f:
        f.write('{"status": "evaluated"}')
    result = call_main("ppo_cartpole_gpu", "--resume", folder, cwd=in_tmp)
    assert_one_error_line(result, "a folder with no checkpoint.pt")


def test_atari_refuses_many_seeds_in_one_line(tmp_path):
    result = run_script("ppo_atari_envpool", "--num-seeds", "2", cwd=tmp_path, timeout=120)
    assert_one_error_line(result, "--num-seeds must be 1: EnvPool runs one seed per process")


@pytest.mark.learning
def test_four_stacked_seeds_solve_cartpole(in_tmp):
    """PPO's defaults, seeds 1-4 in one process (CI): every seed reaches the target within the single-seed budget
    (test_learning.py) and its greedy policy scores 475 or more."""
    P = import_script("ppo_cartpole_gpu")
    train_seeds(P, P.Args(num_seeds=4, device="cpu", progress_bar=False))
    group, dirs = folders(in_tmp, "ppo_cartpole_gpu")
    runs = [read_json(os.path.join(d, "summary.json")) for d in dirs]
    assert [s["status"] for s in runs] == ["target return reached"] * 4, runs
    assert all(s["solved_at_step"] <= 400_000 and s["eval_mean_return"] >= 475 for s in runs), runs
    agg = read_json(os.path.join(group, "summary.json"))
    assert agg["target_reached"] == 4 and agg["eval_iqm"] >= 475


def test_two_stacked_brax_seeds_stopped_and_resumed_equal_one_run(in_tmp, monkeypatch):
    """Brax: each seed steps its own BraxVecEnv in JAX in turn, the update runs stacked (with the agent's observation
    normaliser in its buffers); stopped by SIGTERM and resumed, both seeds end as the two straight through."""
    B = import_script("ppo_mujoco_brax")
    args = B.Args(env_id="inverted_pendulum", num_envs=16, num_steps=10, num_minibatches=4, norm_obs="on",
                  total_timesteps=16 * 10 * 6, target_return=None, progress_bar=False, eval_episodes=0,
                  device="cpu", num_seeds=2)  # fmt: skip
    whole, _, _ = stacked_stopped_and_resumed(B, args, in_tmp, monkeypatch)
    assert not torch.equal(whole[0].actor_mean[0].weight, whole[1].actor_mean[0].weight)


@pytest.mark.quick
def test_the_aggregate_line_counts_runs_at_the_target_only_when_there_was_one():
    """`--target-return None` ends with "no target", not "0/16 reached the target" (before)."""
    from ladder.statistics import aggregate, line

    run = dict(seed=1, env_id="CartPole-v1", status="completed", solved_at_step=None, eval_mean_return=None)
    untargeted = [run | {"seed": seed, "args": {"target_return": None}} for seed in (1, 2)]
    assert line(aggregate(untargeted)) == "no target; none solved; no evaluation"
    targeted = [run | {"args": {"target_return": 475.0}}, run | {"seed": 2, "status": "target return reached"}]
    assert line(aggregate(targeted)).startswith("1/2 reached the target; ")


def test_a_seed_at_its_target_does_not_stop_the_others_resuming(in_tmp, monkeypatch):
    """K seeds stopped by a signal after one of them reached --target-return: the seeds train on together (as they
    did before the signal), so their --resume goes on; only once every seed has ended is it refused."""
    P = import_script("ppo_cartpole_gpu")
    args = small_args(P, num_seeds=2, exp_name="cut", target_return=1e9, eval_episodes=0)
    stop_with_sigterm_at(P, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train_seeds(P, args)
    group, dirs = folders(in_tmp, "cut")
    path = os.path.join(dirs[0], "checkpoint.pt")  # as if seed 1 had reached the target at iteration 3
    saved = torch.load(path, weights_only=True)
    saved["counters"]["target_reached"] = True
    torch.save(saved, path)
    train_seeds(P, replace(args, resume=group))
    statuses = [read_json(os.path.join(d, "summary.json"))["status"] for d in dirs]
    assert statuses == ["target return reached", "completed"]


def test_a_seed_of_k_resumes_alone_from_its_own_folder(in_tmp, monkeypatch):
    """Each seed's folder is a run of its own: one of two stacked seeds stopped by SIGTERM resumes alone (--resume its
    folder, one seed), from its own checkpoint, on its own stream from then on, and completes."""
    P = import_script("ppo_cartpole_gpu")
    args = small_args(P, num_seeds=2, exp_name="cut", eval_episodes=0)
    stop_with_sigterm_at(P, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train_seeds(P, args)
    _, dirs = folders(in_tmp, "cut")
    stopped = read_json(os.path.join(dirs[1], "summary.json"))
    P.train(replace(args, num_seeds=1, seed=2, resume=dirs[1]))
    resumed = read_json(os.path.join(dirs[1], "summary.json"))
    assert (stopped["status"], stopped["iterations"]) == ("interrupted", 3)
    assert (resumed["status"], resumed["iterations"], resumed["seed"]) == ("completed", 6, 2)


def test_a_signal_that_cuts_one_seeds_final_evaluation_cuts_the_next_seeds_too(in_tmp, monkeypatch):
    """A signal during the final evaluation ends it (its handler raises KeyboardInterrupt there): for every seed, each
    summary.json written without its returns. Before, it ended seed 1's alone and seed 2 was evaluated after it (a
    user's trial), its aggregate an IQM of one run."""
    module, calls = import_script("ppo_cartpole_gpu"), []

    def evaluate(*args):
        calls.append(args)
        raise KeyboardInterrupt  # as the final evaluation's SIGTERM handler raises it

    monkeypatch.setattr(module, "evaluate", evaluate)
    module.train(small_args(module, num_seeds=2, eval_episodes=3, exp_name="cut"))
    summaries = [
        read_json(path) for path in sorted(glob.glob(str(in_tmp / "runs" / "*__cut__[12]__*" / "summary.json")))
    ]
    assert len(summaries) == 2 and len(calls) == 1, (len(summaries), len(calls))
    assert [(s["status"], s["eval_returns"]) for s in summaries] == [("completed", None)] * 2
