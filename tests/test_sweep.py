"""--sweep NAME=V1,V2,...: the grid of the algorithm's float flags, --num-seeds K runs of each configuration, all
stacked in one process (each run's values tensors inside the stacked call, as its weights are), ranked at the end."""

import csv
import functools
import glob
import os
from dataclasses import replace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (
    ROOT,
    assert_one_error_line,
    call_main,
    import_script,
    read_json,
    retarget,
    run_script,
    scalars,
    small_args,
    stop_with_sigterm_at,
    train_seeds,
)
from ladder.flags import UsageError
from ladder.optim import Adam
from ladder.seeds import seeds_flags
from ladder.stacked import Stacked
from ladder.sweep import sweep_grid
from recipes import SWEPT_CLIP, recipe_copy, recipe_diff

PPO = os.path.join(ROOT, "ppo_cartpole_gpu.py")


def aggregate_folder(tmp, exp_name: str) -> tuple[str, list[str]]:
    (group,) = glob.glob(os.path.join(str(tmp), "runs", f"*__{exp_name}__*-configurations__*"))
    return group, [os.path.join(str(tmp), d) for d in read_json(os.path.join(group, "summary.json"))["run_dirs"]]


@pytest.mark.quick
@pytest.mark.parametrize("flags, message", [
    (["learning-rat=1e-3"], "--sweep learning-rat: no such flag of the algorithm; did you mean learning-rate?"),
    (["total-timesteps=1000,2000"], "--sweep total-timesteps: a run's flag, not the algorithm's"),
    (["learning-rate=1e-3,fast"], "--sweep learning-rate: 'fast' is not a number"),
    (["learning-rate="], "--sweep learning-rate=: write NAME=V1,V2,..."),
    (["learning-rate=1e-3,"], "--sweep learning-rate: '' is not a number"),
    (["num-envs=64,128"], "--sweep num-envs: an int flag sets shapes or counts"),
    (["norm-adv=0,1"], "--sweep norm-adv: a bool flag picks a branch of the code in Python"),
    (["target-kl=0.01,0.02"], "--sweep target-kl: its type, Optional[float], is not a float"),
    (["seed=1,2"], "--sweep seed: seeds are --num-seeds K's"),
    (["gamma=0.9,0.90"], "--sweep gamma: a value is given twice"),
    (["gamma=0.9", "gamma=0.99"], "--sweep gamma: given twice"),
    (["learning-rate=1e-3,-1"], "--learning-rate must be > 0, got -1.0"),  # Args' own rule
    (["learning-rate=1e-3,inf"], "--learning-rate must be finite, got inf"),
])  # fmt: skip
def test_a_bad_sweep_is_refused_in_one_line_before_anything_is_written(flags, message, in_tmp):
    sweeps = [arg for flag in flags for arg in ("--sweep", flag)]
    result = call_main("ppo_cartpole_gpu", *sweeps, "--num-seeds", "2", "--no-progress-bar", cwd=in_tmp)
    assert_one_error_line(result, message)
    assert not os.path.exists(in_tmp / "runs")


@pytest.mark.quick
def test_a_swept_flag_given_too_is_refused_in_one_line(in_tmp):
    """`--gamma 0.5 --sweep gamma=0.9,0.99`: before, the sweep set gamma and the 0.5 was dropped without a word."""
    result = call_main("ppo_cartpole_gpu", "--gamma", "0.5", "--sweep", "gamma=0.9,0.99", "--no-progress-bar",
                       cwd=in_tmp)  # fmt: skip
    assert_one_error_line(result, "--sweep gamma: --gamma 0.5 is given too; the sweep sets it (leave one out)")
    assert not os.path.exists(in_tmp / "runs")


@pytest.mark.quick
def test_the_grid_is_every_combination_in_order_and_each_run_its_own_flags():
    P = import_script("ppo_cartpole_gpu")
    args = P.Args(sweep=("learning-rate=1e-3,1e-2", "--ent-coef=0,0.01"), num_seeds=2, seed=5, device="cpu")
    grid = sweep_grid(args)
    assert grid == [dict(learning_rate=a, ent_coef=b) for a in (1e-3, 1e-2) for b in (0.0, 0.01)]
    folder, flags = seeds_flags(args, grid, world_size=1, started=0)
    assert "__4-configurations__5-6__" in folder and len(flags) == 8
    assert [(f.learning_rate, f.ent_coef, f.seed) for f in flags[:3]] == [
        (1e-3, 0.0, 5),
        (1e-3, 0.0, 6),
        (1e-3, 0.01, 5),
    ]
    assert all(f.sweep == () and f.num_seeds == 1 for f in flags)  # each folder resumes alone as one run
    assert flags[2].exp_name == "ppo_cartpole_gpu-learning-rate=0.001,ent-coef=0.01"
    with pytest.raises(UsageError, match="--sweep runs its configurations in one process: under torchrun"):
        seeds_flags(args, grid, world_size=2, started=0)
    one = P.Args(sweep=("learning-rate=1e-3",), device="cpu")  # one configuration, one seed: a plain run
    assert seeds_flags(one, sweep_grid(one), world_size=1, started=0)[1][0].learning_rate == 1e-3


def test_a_sweep_of_one_value_is_a_plain_run_with_its_result_line(in_tmp):
    """One configuration and one seed: a plain run, which says its result. Before, nothing was printed (a sweep's
    runs leave it to the ranking, which one run does not have)."""
    result = call_main("ppo_cartpole_gpu", "--sweep", "gamma=0.9", "--num-envs", "32", "--total-timesteps", "2048",
                       "--eval-episodes", "0", "--no-progress-bar", cwd=in_tmp)  # fmt: skip
    assert result.returncode == 0 and result.stdout.startswith("completed: total_env_steps 2,048"), result.stdout


def test_atari_refuses_a_sweep_in_one_line(tmp_path):
    result = run_script("ppo_atari_envpool", "--sweep", "learning-rate=1e-4,3e-4", cwd=tmp_path, timeout=120)
    assert_one_error_line(result, "--sweep must be left out: EnvPool runs one configuration per process")


def learn(module, agent, optimizer, rollout, args):
    """The update `train()`'s iteration makes of a rollout (PPO: the epochs of minibatch steps; VPG: its step)."""
    if hasattr(module, "ppo_loss"):
        step = functools.partial(module.gradient_step, agent, optimizer, module.ppo_loss, args)
        return module.update(functools.partial(module.one_epoch, step), module.make_batch(agent, rollout, args), args)
    step = functools.partial(module.gradient_step, agent, optimizer, module.vpg_loss, args)
    return module.update(step, module.make_batch(agent, rollout, args), args)


@pytest.mark.parametrize("script", ["ppo_cartpole_gpu", "vpg", "swept clip"])
def test_each_configuration_learns_in_the_stacked_call_as_alone(script, tmp_path):
    """One update of two runs stacked, whose flags differ in five or six swept values at once (the rate Adam reads, the
    discount and GAE's lambda, the loss's coefficients and its clipping; the clip recipe's max norm): each run's
    weights and losses are those of
    the same update made alone with its flags, within float tolerance; Python's float flags are each run's tensors
    inside the call. (One minibatch: its shuffled order changes only the sums' order.)"""
    M = import_script(script) if script != "swept clip" else recipe_copy(PPO, str(tmp_path), SWEPT_CLIP, "clip")
    values = [
        dict(learning_rate=1e-2, gamma=0.9, gae_lambda=0.8, ent_coef=0.0, vf_coef=0.5, clip_coef=0.1),
        dict(learning_rate=3e-3, gamma=0.99, gae_lambda=0.95, ent_coef=0.1, vf_coef=2.0, clip_coef=0.3),
    ]
    names = list(values[0]) if script != "vpg" else list(values[0])[:5]  # VPG's clip_coef may be None: not swept
    same = dict(num_minibatches=1, update_epochs=2) if script != "vpg" else dict(clip_coef=0.2)
    values = [v | same | dict(max_grad_norm=0.05) for v in values]  # (clipped: both)
    if script == "swept clip":  # its max norm swept too: one run clipped, the other not
        values[1]["max_grad_norm"], names = 5.0, names + ["max_grad_norm"]
    flags = [small_args(M, num_envs=8, num_steps=8, **v) for v in values]

    def build(k):
        torch.manual_seed(k)
        envs = M.make_envs(flags[k], torch.device("cpu"), None, k)
        agent = M.Agent(envs.obs_dim, envs.num_actions)
        rollout = M.Rollout.empty(8, 8, envs.obs_dim, torch.device("cpu"))
        M.collect_rollout(agent, envs, envs.reset()[0], rollout, M.RolloutNoise.draw(envs, 8))
        return agent, Adam(agent, lr=flags[k].learning_rate, eps=1e-5), rollout

    alone = [build(k) for k in range(2)]
    stats_alone = [learn(M, *alone[k], flags[k]) for k in range(2)]
    built = [build(k) for k in range(2)]
    agent, optimizer, _ = built[-1]
    stack = Stacked([{"agent": a, "optimizer": o} for a, o, _ in built], flags, names)
    rollouts = M.Rollout(*map(torch.stack, zip(*[r for *_, r in built])))
    stats = stack.call(lambda rollout: learn(M, agent, optimizer, rollout, flags[-1]), rollouts)
    stack.release()
    assert flags[-1].gamma == 0.99 and isinstance(flags[-1].clip_coef, float)  # the lead's flags as they were
    for k in range(2):
        for (name, a), b in zip(built[k][0].state_dict().items(), alone[k][0].state_dict().values()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"run {k + 1}: {name}")
        for tag, value in stats_alone[k].items():
            torch.testing.assert_close(stats[tag][k], value, atol=1e-6, rtol=1e-5, msg=f"run {k + 1}: {tag}")
    assert not torch.equal(*[a.state_dict()["critic.0.weight"] for a, *_ in built])


@pytest.mark.behaviour
@pytest.mark.parametrize("script", retarget(["ppo_cartpole_gpu", "vpg"]))
def test_a_sweep_is_a_run_per_configuration_and_seed_ranked_in_its_aggregate(script, in_tmp, capsys):
    """Two learning rates x two discounts x two seeds: eight run folders, each with its flags in summary.json and its
    own annealed rate; the aggregate ranks the four configurations by their seeds' evaluation IQM (CSV, JSON, PNG,
    and the table printed instead of a line per run), and its summary.json pools no statistic across them."""
    M = import_script(script)
    args = small_args(M, num_seeds=2, exp_name="grid", sweep=("learning-rate=1e-3,1e-2", "gamma=0.9,0.99"))
    agents = train_seeds(M, args)
    group, dirs = aggregate_folder(in_tmp, "grid")
    runs = [read_json(os.path.join(d, "summary.json")) for d in dirs]
    assert len(agents) == 8 and [s["seed"] for s in runs] == [1, 2] * 4
    assert [(s["args"]["learning_rate"], s["args"]["gamma"]) for s in runs[::2]] == [
        (1e-3, 0.9),
        (1e-3, 0.99),
        (1e-2, 0.9),
        (1e-2, 0.99),
    ]
    for d, s in zip(dirs, runs):
        rates = [rate for _, rate in scalars(d)["charts/learning_rate"][:2]]  # annealed over 6 iterations
        assert rates == pytest.approx([s["args"]["learning_rate"], s["args"]["learning_rate"] * 5 / 6], rel=1e-6)
        assert s["args"]["sweep"] == []
    ranking = read_json(os.path.join(group, "ranking.json"))
    assert len(ranking) == 4 and [r["eval_iqm"] for r in ranking] == sorted(
        (r["eval_iqm"] for r in ranking), reverse=True
    )
    with open(os.path.join(group, "ranking.csv")) as f:
        assert [row["config"] for row in csv.DictReader(f)] == [r["config"] for r in ranking]
    assert os.path.getsize(os.path.join(group, "learning_curves.png")) > 10_000
    out = capsys.readouterr().out
    assert "4 configurations x 2 seeds, ranked:" in out and "completed:" not in out
    aggregate = read_json(os.path.join(group, "summary.json"))
    assert aggregate["args"]["sweep"] == list(args.sweep) and aggregate["num_seeds"] == 2  # (it said 8: the runs)
    assert "eval_iqm" not in aggregate  # one IQM over all four configurations would mean nothing: ranking.json's
    events = EventAccumulator(dirs[0])  # TensorBoard's HPARAMS tab: each run's flags, compared across folders
    events.Reload()
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


@pytest.mark.parametrize("script", ["reinforce", "ppo_mujoco_brax"])
def test_reinforce_and_brax_sweep_as_their_seeds_stack(script, in_tmp):
    """REINFORCE (its chunks and update stacked) and Brax (its JAX envs stepped run by run, its update stacked): two
    discounts, a run folder each with its own, ranked."""
    M = import_script(script)
    brax = dict(env_id="inverted_pendulum", num_envs=16, num_steps=10, num_minibatches=4, total_timesteps=480)
    brax |= dict(eval_episodes=0)  # (as test_many_seeds.py's two Brax seeds: JAX's compilations shared)
    args = small_args(M, exp_name="grid", sweep=("gamma=0.9,0.99",), **(brax if script == "ppo_mujoco_brax" else {}))
    train_seeds(M, args)
    group, dirs = aggregate_folder(in_tmp, "grid")
    assert [read_json(os.path.join(d, "summary.json"))["args"]["gamma"] for d in dirs] == [0.9, 0.99]
    assert len(read_json(os.path.join(group, "ranking.json"))) == 2


def test_a_sweep_stopped_and_resumed_from_the_command_line_equals_one_straight_through(in_tmp, monkeypatch):
    """SIGTERM after iteration 3, then `--resume <aggregate>` with its `--sweep` typed again (the flags come from the
    folder; before, tyro added the sweep given to the folder's, and the same grid was refused): every run's scalars
    and weights are those of the sweep trained straight through, bit for bit. Another grid is refused, naming it, and
    another --num-seeds says how many runs the folder holds (it said only how many the command makes)."""
    P = import_script("ppo_cartpole_gpu")
    args = small_args(P, sweep=("learning-rate=1e-3,1e-2", "clip-coef=0.1,0.3"), eval_episodes=0)
    whole = train_seeds(P, replace(args, exp_name="whole"))
    stop_with_sigterm_at(P, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train_seeds(P, replace(args, exp_name="cut"))
    monkeypatch.undo()
    group, dirs = aggregate_folder(in_tmp, "cut")
    assert {read_json(os.path.join(d, "summary.json"))["status"] for d in dirs} == {"interrupted"}
    assert not os.path.exists(os.path.join(group, "ranking.json"))  # no ranking of runs not ended (there was one)
    again = ["--sweep", "learning-rate=1e-3,1e-2", "--sweep", "clip-coef=0.1,0.3"]
    resumed = call_main("ppo_cartpole_gpu", "--resume", group, *again, "--no-progress-bar", cwd=in_tmp)
    assert resumed.returncode == 0, resumed.stderr
    for k, d in enumerate(aggregate_folder(in_tmp, "whole")[1]):
        assert scalars(dirs[k]) == scalars(d), f"run {k + 1}"
        saved = torch.load(os.path.join(dirs[k], "checkpoint.pt"), weights_only=True)["agent"]
        for (name, a), b in zip(whole[k].state_dict().items(), saved.values()):
            assert torch.equal(a, b), f"run {k + 1}: {name}"
    other = call_main("ppo_cartpole_gpu", "--resume", group, "--sweep", "learning-rate=1e-3", cwd=in_tmp)
    assert_one_error_line(other, "--sweep must be the checkpoint's ('learning-rate=1e-3,1e-2', 'clip-coef=0.1,0.3')")
    assert other.stderr.strip().endswith("got ('learning-rate=1e-3',)"), other.stderr
    more = call_main("ppo_cartpole_gpu", "--resume", group, *again, "--num-seeds", "2", cwd=in_tmp)  # 8 runs, not 4
    assert_one_error_line(more, f"this --sweep takes the aggregate folder of its 8 runs ({group} holds 4: the --num-s")


def test_a_compiled_sweep_trains_as_the_eager_one(in_tmp):
    """--compile: the stacked iteration of two configurations as one graph, the swept values its inputs (a float
    flag would be baked in as a constant, one graph per value): each run trains as the eager sweep's."""
    P = import_script("ppo_cartpole_gpu")
    tiny = dict(num_envs=8, num_steps=4, num_minibatches=1, update_epochs=2, total_timesteps=8 * 4 * 6)
    args = small_args(P, sweep=("learning-rate=1e-3,1e-2", "ent-coef=0,0.1"), eval_episodes=0, **tiny)
    eager = train_seeds(P, replace(args, exp_name="eager"))
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = train_seeds(P, replace(args, exp_name="compiled", compile=True))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    for k in range(4):
        for (name, a), b in zip(compiled[k].state_dict().items(), eager[k].state_dict().values()):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3, msg=f"run {k + 1}: {name}")


def test_a_flag_the_code_reads_as_a_number_is_refused_in_one_line(in_tmp):
    """A copy whose loss branches on --ent-coef in Python: sweeping it stops at the first stacked call in one line
    naming the flag and the copy's line (each run's value is a tensor there, with no one truth value)."""
    source = open(import_script("ppo_cartpole_gpu").__file__).read()
    edited = source.replace(
        "    entropy_loss = entropy.mean()\n", "    entropy_loss = entropy.mean() if args.ent_coef else 0\n"
    )
    assert edited != source
    (in_tmp / "branching.py").write_text(edited)
    result = run_script(str(in_tmp / "branching"), "--sweep", "ent-coef=0,0.01", "--num-envs", "8",
                        "--total-timesteps", "1024", "--no-progress-bar", cwd=in_tmp,
                        env=os.environ | {"PYTHONPATH": ROOT})  # fmt: skip
    assert_one_error_line(result, "--sweep --ent-coef: vmap: It looks like you're")
    assert "branching.py:" in result.stderr and "a flag Python reads as a number cannot be swept" in result.stderr


def test_max_grad_norm_through_torchs_clip_grad_norm_is_refused_in_one_line(in_tmp):
    """torch's clip_grad_norm_ reads `max_norm` with float(): a swept --max-grad-norm stops at the first stacked call,
    naming the line (docs/running.md#sweeps shows the clip that sweeps it)."""
    result = call_main("ppo_cartpole_gpu", "--sweep", "max-grad-norm=0.5,1", "--num-envs", "8",
                       "--total-timesteps", "1024", "--no-progress-bar", cwd=in_tmp)  # fmt: skip
    assert_one_error_line(result, "--sweep --max-grad-norm: vmap: It looks like you're calling .item() on a Tensor")
    assert "ppo_cartpole_gpu.py:" in result.stderr


@pytest.mark.parametrize("script", ["ppo_cartpole_gpu", "vpg"])
def test_a_sweep_replayed_as_a_cuda_graph_equals_it_as_written(script, in_tmp, monkeypatch, capsys):
    """On a GPU the stacked call of a sweep is recorded once and replayed (here on the CPU, tests/test_graph.py): the
    swept values, inputs of the recording, give each run the scalars and weights of the sweep as written."""
    from test_graph import replayed_on_the_cpu

    M = import_script(script)
    args = small_args(M, sweep=("learning-rate=1e-3,1e-2", "gamma=0.9,0.99"), eval_episodes=0, cuda_graph=True)
    plain = train_seeds(M, replace(args, exp_name="plain"))
    replayed_on_the_cpu(M, monkeypatch)
    replayed = train_seeds(M, replace(args, exp_name="replayed"))
    assert " of 4 seeds as one CUDA graph" in capsys.readouterr().err
    for k, (a, b) in enumerate(zip(aggregate_folder(in_tmp, "plain")[1], aggregate_folder(in_tmp, "replayed")[1])):
        assert scalars(a) == scalars(b), f"run {k + 1}"
        for key, value in plain[k].state_dict().items():
            assert torch.equal(value, replayed[k].state_dict()[key]), f"run {k + 1}: {key}"


@pytest.mark.quick
def test_the_docs_show_the_clip_recipe_as_the_tests_make_it():
    with open(os.path.join(ROOT, "docs", "modifying.md")) as f:
        shown = f.read().split("<!-- recipe: swept clip -->\n```diff\n", 1)[1].split("\n```", 1)[0]
    assert shown == recipe_diff(PPO, SWEPT_CLIP)


def test_the_clip_recipe_sweeps_max_grad_norm(in_tmp):
    """The recipe's copy sweeps --max-grad-norm from the command line (torch's clip_grad_norm_ refuses it, above)."""
    recipe_copy(PPO, str(in_tmp), SWEPT_CLIP, "clip")
    result = run_script(str(in_tmp / "clip_ppo_cartpole_gpu"), "--sweep", "max-grad-norm=0.05,5", "--num-envs", "8",
                        "--total-timesteps", "1024", "--eval-episodes", "1", "--no-progress-bar", cwd=in_tmp,
                        env=os.environ | {"PYTHONPATH": ROOT})  # fmt: skip
    assert result.returncode == 0 and "2 configurations x 1 seeds, ranked:" in result.stdout, result.stderr


def test_a_scheduler_with_a_sweep_is_refused_in_one_line(in_tmp, monkeypatch):
    """A sweep's rates are one tensor of its runs', which torch's schedulers (`fill_` of one number) cannot set."""
    from test_modifications import lr_scheduler, short_flags

    lr_scheduler(import_script("ppo_cartpole_gpu"), monkeypatch)
    result = call_main("ppo_cartpole_gpu", *short_flags("ppo_cartpole_gpu"), "--no-anneal-lr", "--sweep",
                       "ent-coef=0,0.01", cwd=in_tmp)  # fmt: skip
    assert_one_error_line(result, "--sweep with a torch.optim.lr_scheduler: torch's schedulers set one rate")
