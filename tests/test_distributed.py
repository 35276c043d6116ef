"""Data parallel under torchrun: 2 processes on the CPU (Gloo), as `torchrun --nproc_per_node 2` runs them."""

import glob
import os
import signal
import sys

import pytest
import torch
from dp_worker import fixed_batch, update_batches, updated

from conftest import ROOT, assert_close, import_script, interrupt_after_an_iteration, read_json, torchrun
from ladder import distributed
from ladder.optim import Adam

P = import_script("ppo_cartpole_gpu")


@pytest.fixture(scope="module")
def worker_outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    result = torchrun(os.path.join(ROOT, "tests", "dp_worker.py"), str(out), cwd=out)
    assert result.returncode == 0, result.stderr[-3000:]
    (out / "stderr.txt").write_text(result.stderr)
    return out


def single_process_step(norm_adv: bool) -> dict:
    """What 2 ranks with half a batch each must give: the mean of the two halves' losses (each half's
    advantages normalised on their own, as each rank does), one clipped Adam step."""
    torch.manual_seed(0)
    agent = P.Agent(4, 2)
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-2, eps=1e-5)
    args, batch = P.Args(norm_adv=norm_adv, max_grad_norm=0.05), fixed_batch()
    halves = [P.ppo_loss(agent, args, P.Batch(*(x[32 * r : 32 * (r + 1)] for x in batch)))[0] for r in (0, 1)]
    (sum(halves) / 2).backward()
    torch.nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return agent.state_dict()


@pytest.mark.parametrize("norm_adv", [False, True])
def test_two_ranks_take_the_single_process_step(worker_outputs, norm_adv):
    """Gradients averaged over 2 ranks = one process on the whole batch. Without advantage normalisation
    that is exactly the full-batch loss; with it, each rank normalises its own half (as CleanRL's
    multi-GPU PPO), so the reference is the mean of the two halves' normalised losses."""
    expected = single_process_step(norm_adv)
    for rank in (0, 1):
        got = torch.load(worker_outputs / f"step_norm{int(norm_adv)}_rank{rank}.pt")
        for key in expected:
            assert_close(got[key], expected[key], key, atol=1e-6, rtol=1e-5)
    if not norm_adv:  # CleanRL's update as docs/modifying.md writes it (loss.backward(), average_gradients) alike
        for rank in (0, 1):
            got = torch.load(worker_outputs / f"step_cleanrl_rank{rank}.pt")
            for key in expected:
                assert_close(got[key], expected[key], f"CleanRL's update, rank {rank}: {key}", atol=1e-6, rtol=1e-5)
        # and then it is the plain full-batch step
        torch.manual_seed(0)
        agent = P.Agent(4, 2)
        optimizer = Adam(agent, lr=1e-2, eps=1e-5)
        P.gradient_step(agent, optimizer, P.ppo_loss, P.Args(norm_adv=False, max_grad_norm=0.05), fixed_batch())
        for key, value in agent.state_dict().items():
            assert_close(value, expected[key], key, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("norm_adv", [False, True])
def test_the_stats_a_gradient_step_returns_are_the_ranks_means(worker_outputs, norm_adv):
    """So every rank reads the same approximate KL, and `--target-kl` stops their epochs together."""
    torch.manual_seed(0)
    agent, args, batch = P.Agent(4, 2), P.Args(norm_adv=norm_adv), fixed_batch()
    halves = [P.ppo_loss(agent, args, P.Batch(*(x[32 * r : 32 * (r + 1)] for x in batch)))[1] for r in (0, 1)]
    for rank in (0, 1):
        got = torch.load(worker_outputs / f"stats_norm{int(norm_adv)}_rank{rank}.pt")
        assert set(got) == set(halves[0])
        for tag in got:
            assert_close(got[tag], (halves[0][tag] + halves[1][tag]) / 2, tag, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["ppo_cartpole_gpu", "vpg", "reinforce"])
def test_ranks_stay_bit_identical_and_rank_0_writes_alone(worker_outputs, name):
    label = "" if name == "ppo_cartpole_gpu" else f"{name}_"
    weights = [torch.load(worker_outputs / f"train_{label}rank{rank}.pt") for rank in (0, 1)]
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
    (path,) = glob.glob(str(worker_outputs / "runs" / f"*__{name}__*" / "summary.json"))  # rank 0's folder alone
    summary = read_json(path)
    assert summary["world_size"] == 2 and summary["status"] == "completed"
    if name != "reinforce":  # whose rollouts end once every env has finished an episode
        assert summary["total_env_steps"] == 2 * 16 * 8 * 5 and summary["iterations"] == 5


@pytest.mark.parametrize("name", ["atari", "brax"])
def test_atari_and_brax_updates_on_two_ranks_equal_one_process(worker_outputs, name):
    """Their `update` (2 epochs over one minibatch, no advantage normalisation) on 2 ranks with half a
    batch each ends where one process on the whole batch does."""
    expected = updated(name, update_batches()[name])
    for rank in (0, 1):
        got = torch.load(worker_outputs / f"update_{name}_rank{rank}.pt")
        for key in expected:
            assert_close(got[key], expected[key], key, atol=1e-6, rtol=1e-5)


def test_observation_statistics_cover_all_ranks(worker_outputs):
    """Brax's observation normaliser on 2 ranks with half a batch each = one process on the whole batch."""
    rms = import_script("ppo_mujoco_brax").RunningMeanStd((3,))
    rms.update(torch.randn(40, 3, generator=torch.Generator().manual_seed(2)) * 2 + 1)
    for rank in (0, 1):
        got = torch.load(worker_outputs / f"rms_rank{rank}.pt")
        for key, value in rms.state_dict().items():
            assert_close(got[key], value, key)


@pytest.mark.parametrize("script, flags", [
    ("ppo_atari_envpool", ["--num-envs", "4", "--total-timesteps", "1024", "--async-envs", "--save-model"]),
    ("ppo_mujoco_brax", ["--env-id", "inverted_pendulum", "--num-envs", "16", "--num-steps", "8",
                         "--total-timesteps", "1024", "--save-model", "--norm-obs", "on"]),
])  # fmt: skip
def test_short_atari_and_brax_runs_under_torchrun(tmp_path, script, flags):
    import_script(script)  # skips where the simulator is not installed
    result = torchrun(os.path.join(ROOT, script + ".py"), *flags, "--no-progress-bar", "--eval-episodes", "1",
                      cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "runs" / "*" / "summary.json"))  # one run folder: rank 0's
    summary = read_json(path)
    assert summary["world_size"] == 2 and summary["status"] == "completed" and summary["model_path"], summary
    assert summary["total_env_steps"] >= 1000 and len(summary["eval_returns"]) == 1


@pytest.mark.learning
def test_torchrun_solves_cartpole(tmp_path):
    result = torchrun(os.path.join(ROOT, "ppo_cartpole_gpu.py"), "--no-progress-bar", "--eval-episodes", "0",
                      "--target-return", "475", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "runs" / "*" / "summary.json"))
    summary = read_json(path)
    assert summary["world_size"] == 2 and summary["status"] == "target return reached", summary
    assert summary["solved_at_step"] <= 400_000
    assert result.stdout.count("target return reached") == 1  # rank 0 prints the result line alone


def test_compiled_under_torchrun_the_ranks_stay_identical_and_match_eager(worker_outputs):
    """--compile under torchrun: each rank's loss compiled, its gradients all-reduced by `gradient_step` (the one-graph
    step with Adam written out would not all-reduce: `cannot_take_functional_step` says so, and torchrun runs take
    the other way): both ranks end bit-identical, and where the eager torchrun run ends (the compiled tanh and sums
    round differently)."""
    eager = torch.load(worker_outputs / "train_rank0.pt")
    compiled = [torch.load(worker_outputs / f"train_compiled_rank{rank}.pt") for rank in (0, 1)]
    for key in eager:
        assert torch.equal(compiled[0][key], compiled[1][key]), key
        assert_close(compiled[0][key], eager[key], key, atol=2e-4, rtol=1e-3)


def test_ctrl_c_under_torchrun_stops_every_rank_with_a_checkpoint_that_resumes(tmp_path):
    """torchrun passes Ctrl-C (SIGINT) to every rank: they stop after the same iteration, rank 0 writes a
    checkpoint holding both ranks' envs and RNGs, and torchrun --resume goes on from it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = os.path.join(ROOT, "ppo_cartpole_gpu.py")
    flags = ["--total-timesteps", "100000000", "--target-return", "None", "--no-progress-bar", "--num-envs", "32"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *flags]
    err = interrupt_after_an_iteration(command, tmp_path, signal.SIGINT, env=env, timeout=120).stderr
    assert "interrupted by SIGINT, with a checkpoint" in err, err[-3000:]
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "*"))
    summary = read_json(os.path.join(run_dir, "summary.json"))
    saved = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)
    assert summary["status"] == "interrupted" and summary["world_size"] == 2
    assert saved["counters"]["iteration"] == summary["iterations"] > 0 and len(saved["ranks"]) == 2
    assert not torch.equal(saved["ranks"][0]["envs"]["state"], saved["ranks"][1]["envs"]["state"])
    more = str(summary["total_env_steps"] + 2 * 32 * 16 * 3)  # three more iterations
    result = torchrun(script, "--resume", run_dir, "--total-timesteps", more, "--eval-episodes", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(os.path.join(run_dir, "summary.json"))
    assert summary["status"] == "completed" and summary["iterations"] == saved["counters"]["iteration"] + 3


def test_track_without_a_wandb_login_under_torchrun_ends_in_rank_0s_one_line(tmp_path):
    """Rank 0 alone opens the W&B run: without a login its one line, and the other rank stops with it (a user's
    trial: rank 1 trained on into the gradients' all-reduce and ended in ~30 lines of Gloo's traceback)."""
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": "", "WANDB_MODE": "online", "WANDB_DIR": str(tmp_path)}
    flags = ["--total-timesteps", "8192", "--num-envs", "32", "--no-progress-bar", "--track"]
    result = torchrun(os.path.join(ROOT, "ppo_cartpole_gpu.py"), *flags, cwd=tmp_path, env=env, timeout=240)
    errors = [line for line in result.stderr.splitlines() if "error: " in line]
    assert result.returncode != 0 and len(errors) == 1 and "--track: No API key configured" in errors[0], result.stderr
    assert "[rank1]" not in result.stderr and "Connection closed" not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("compiled", [[], ["--compile"]], ids=["eager", "compiled"])
def test_a_final_evaluation_longer_than_the_collective_timeout_finishes(tmp_path, compiled):
    """Rank 0 evaluates alone at the end while the other ranks are done: with collectives timing out after 3 s (5 min
    in the scripts) and an evaluation of 5 s (Brax's could take minutes), the run still ends well, with its summary
    (before, the other ranks timed out in a final barrier and torchrun killed rank 0 before it wrote summary.json).
    And `main` frees the process group: its Gloo threads are gone before the interpreter exits (before, torch's first
    optimizer imported torch.distributed.nn, whose defaults kept the group, so its threads ran on into the exit, where
    now and then one aborted rank 1: "terminate called without an active exception", and torchrun stopped rank 0).
    Compiled too: a graph holds the group it all-reduces over, which dynamo kept in the script's globals."""
    worker = tmp_path / "slow_evaluation.py"
    worker.write_text(f"""
import datetime, os, sys, time
sys.path.insert(0, {ROOT!r})
import torch.distributed as dist
import ppo_cartpole_gpu as P
init, evaluate = dist.init_process_group, P.evaluate
dist.init_process_group = lambda backend, **kw: init(backend, **kw | {{"timeout": datetime.timedelta(seconds=3)}})
P.evaluate = lambda *args: time.sleep(5) or evaluate(*args)
P.main()
tasks = "/proc/self/task"  # Linux: the process's threads by name (elsewhere none are listed)
names = [open(os.path.join(tasks, t, "comm")).read().strip() for t in os.listdir(tasks)] if os.path.isdir(tasks) else []
if any("gloo" in name for name in names):
    sys.exit(f"rank {{os.environ['RANK']}}: the process group's threads outlive main: {{names}}")
""")
    flags = ["--num-envs", "16", "--num-steps", "8", "--total-timesteps", "512", "--eval-episodes", "2",
             "--no-progress-bar", *compiled]  # fmt: skip
    result = torchrun(str(worker), *flags, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Exception ignored" not in result.stderr, result.stderr[-3000:]  # (dynamo's names deleted twice: KeyError)
    (path,) = glob.glob(str(tmp_path / "runs" / "*" / "summary.json"))
    summary = read_json(path)
    assert summary["status"] == "completed" and summary["world_size"] == 2 and len(summary["eval_returns"]) == 2


def test_a_second_network_starts_alike_and_drifting_apart_is_noted(worker_outputs):
    """A network trained besides the agent (an RND predictor and its target, given to `run.start`): every rank starts
    from rank 0's weights (the target, never trained, stays identical); trained without averaging its gradients the
    predictor drifts apart and a note at the checkpoint names it; with `average_gradients` it stays identical. Before,
    the target differed by up to 0.88 across the ranks, the predictor's gradients were never averaged, and the run
    ended with a normal result line."""
    nets = {average: [torch.load(worker_outputs / f"second_averaged{average}_rank{r}.pt") for r in (0, 1)]
            for average in (0, 1)}  # fmt: skip
    for average, (rank0, rank1) in nets.items():
        for key, value in rank0["target"].items():
            assert torch.equal(value, rank1["target"][key]), key
        same = all(torch.equal(v, rank1["predictor"][k]) for k, v in rank0["predictor"].items())
        assert same == bool(average)
    notes = [line for line in (worker_outputs / "stderr.txt").read_text().splitlines() if "predictor differs" in line]
    assert notes == ["note: predictor differs between the torchrun ranks (average its gradients: average_gradients("
                     "predictor) between backward() and step(), docs/modifying.md); rank 0's is saved"]  # fmt: skip


def test_a_recurrent_policy_stopped_and_resumed_under_torchrun_equals_one_run(worker_outputs):
    """docs/modifying.md's recurrent recipe (a GRU policy on the CartPole without velocities, each rank's hidden state
    its own as `PerRank`) under torchrun with 2 ranks, stopped after iteration 2 and resumed: one run's weights, alike
    on both ranks. Before, the hidden state was broadcast from rank 0 at start and saved as rank 0's: 0.19 off."""
    load = lambda name, rank: torch.load(worker_outputs / f"{name}_rank{rank}.pt")
    whole, resumed = load("gru_stopped0", 0), load("gru_stopped2", 0)
    assert any(key.startswith("actor.0.gru") for key in whole)
    for key, value in whole.items():
        assert torch.equal(value, resumed[key]), key
        assert torch.equal(load("gru_stopped2", 1)[key], resumed[key]), f"rank 1: {key}"


def test_state_each_rank_keeps_its_own_resumes_as_one_run(worker_outputs):
    """A tensor each rank keeps its own of (here a running mean of its observations, which the loss reads; in a copy,
    a recurrent policy's hidden state), given to `run.start` as `PerRank`: saved and restored per rank, so a run
    stopped after iteration 2 and resumed under torchrun ends with one run's weights, alike on both ranks. Given as a
    plain tensor the same: at the checkpoint the ranks' copies differ, so each rank's is saved and resumed, and a note
    names it. Before PerRank the resumed run's weights were 0.19 off (the issue's GRU copy); before the rule, the plain
    tensor was saved as rank 0's and the resumed run ended elsewhere, with a note only."""
    load = lambda name, rank: torch.load(worker_outputs / f"{name}_rank{rank}.pt")
    whole = load("per_rank1_stopped0", 0)
    for name in ("per_rank1_stopped2", "per_rank0_stopped2"):
        for key, value in whole.items():
            assert torch.equal(value, load(name, 0)[key]), f"{name}: {key}"
            assert torch.equal(load(name, 1)[key], value), f"{name}, rank 1: {key}"
    notes = {line for line in (worker_outputs / "stderr.txt").read_text().splitlines() if "obs_mean differ" in line}
    assert notes == {"note: obs_mean differs between the torchrun ranks: each rank's is saved and resumed as its own "
                     "(docs/modifying.md#your-own-state)"}  # fmt: skip


def test_the_three_recipes_stopped_and_resumed_under_torchrun_equal_one_run(worker_outputs):
    """The copy with tests/recipes.py's three recipes under torchrun with 2 ranks: each rank's running statistics of
    its own observations (buffers of the agent) differ, the weights stay alike (the RND predictor's gradients averaged
    with the agent's), and a run stopped after iteration 2 and resumed ends as one run on each rank, statistics
    included: the checkpoint keeps each rank's own, and a note names them. Before, the resume gave rank 1 rank 0's
    statistics: the issue's copy evaluated 164 straight through, 500 resumed."""
    load = lambda name, rank: torch.load(worker_outputs / f"recipes_stopped{name}_rank{rank}.pt")
    for rank in (0, 1):
        whole, resumed = load(0, rank), load(2, rank)
        for key, value in whole.items():
            assert torch.equal(value, resumed[key]), f"rank {rank}: {key}"
    ranks = [load(0, rank) for rank in (0, 1)]
    assert not torch.equal(ranks[0]["obs_rms.mean"], ranks[1]["obs_rms.mean"])
    for key in [key for key in ranks[0] if "rms" not in key]:
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    notes = [line for line in (worker_outputs / "stderr.txt").read_text().splitlines() if "agent.obs_rms" in line]
    assert notes and all(" differ between the torchrun ranks: each rank's is saved and resumed" in n for n in notes)


def test_weights_that_drift_apart_after_their_modules_buffers_did_are_noted(monkeypatch):
    """A module whose buffers differ between the ranks (observation statistics: each rank keeps its own) and whose
    weights later drift apart too (an auxiliary head trained without `average_gradients`): both are noted. Before,
    the module was noted once, by its name, so its weights drifting went unsaid and rank 0's alone were saved."""
    agent = torch.nn.Linear(2, 2)
    agent.register_buffer("mean", torch.zeros(2))
    apart, noted, notes = set(), set(), []

    def all_gather_object(ranks, sums):  # rank 1's checksums: rank 0's, but for the names `apart`
        ranks[:] = [sums, {name: value + (name in apart) for name, value in sums.items()}]

    monkeypatch.setattr(distributed.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    for differing in ({"agent.mean"}, {"agent.mean", "agent.weight"}, {"agent.mean", "agent.weight"}):
        apart.clear()
        apart.update(differing)
        own = distributed.ranks_apart({"agent": agent}, noted, notes.append)
        assert set(own) == {"agent.mean"}  # a buffer: each rank's own, saved; the weights: rank 0's
    assert notes == [
        "agent.mean differs between the torchrun ranks: each rank's is saved and resumed as its own"
        " (docs/modifying.md#your-own-state)",
        "agent differs between the torchrun ranks (average its gradients: average_gradients(agent) between backward()"
        " and step(), docs/modifying.md); rank 0's is saved",
    ]
