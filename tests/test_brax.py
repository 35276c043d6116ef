"""ppo_mujoco_brax.py: the Brax wrapper (shapes, DLPack, truncation, fresh resets, one compilation), the
observation normaliser, videos that leave training alone, bad input and short real runs."""

import ctypes.util
import glob
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from conftest import (
    ROOT,
    SUMMARY_KEYS,
    assert_one_error_line,
    call_main,
    fake_wandb,
    import_script,
    read_json,
    run_script,
    start_in_background,
)

B = import_script("ppo_mujoco_brax")


@pytest.fixture(scope="module")
def pendulum():
    """4 inverted pendulums with 5-step episodes (compiled once for the module)."""
    return B.BraxVecEnv("inverted_pendulum", "spring", 4, 5, "cpu", seed=0)


def test_wrapper_shapes_and_dtypes(pendulum):
    obs, info = pendulum.reset()
    assert obs.shape == (4, 4) and obs.dtype == torch.float32 and info == {}
    obs, reward, terminated, truncated, info = pendulum.step(torch.zeros(4, 1))
    assert obs.shape == (4, 4) and reward.shape == (4,) and reward.dtype == torch.float32
    assert terminated.dtype == truncated.dtype == torch.bool and terminated.shape == truncated.shape == (4,)
    assert info["final_obs"].shape == (4, 4) and info["episode_length"].dtype == torch.int32


def test_dlpack_round_trip_is_zero_copy_and_bit_exact(pendulum):
    x = torch.randn(4096, 27)
    j = pendulum.to_jax(x)
    assert j.unsafe_buffer_pointer() == x.data_ptr()  # JAX reads torch's memory
    back = pendulum.to_torch(j)
    assert back.data_ptr() == x.data_ptr() and torch.equal(back, x)
    flags = torch.rand(100) > 0.5
    assert torch.equal(pendulum.to_torch(pendulum.to_jax(flags)), flags)


def test_time_limit_truncates_with_the_final_observation_and_fresh_resets(pendulum):
    first, _ = pendulum.reset()
    for t in range(1, 6):  # the pendulums stay up for 5 steps with no force
        before = pendulum.state.obs
        obs, reward, terminated, truncated, info = pendulum.step(torch.zeros(4, 1))
        assert not terminated.any()
        assert truncated.all() == (t == 5) and truncated.any() == (t == 5)
    assert torch.all(info["episode_length"] == 5) and torch.allclose(info["episode_return"], torch.full((4,), 5.0))
    # the real last observation is kept, and differs from the new episode's first one
    assert not torch.equal(info["final_obs"], obs) and not torch.equal(info["final_obs"], pendulum.to_torch(before))
    # new episodes start from fresh random states, not from the first reset's (Brax's AutoResetWrapper does that)
    assert not torch.equal(obs, first)
    assert obs.abs().max() < 0.1


def test_reset_and_step_compile_once(pendulum):
    """The arrays JAX returns are committed to its device; a first call on uncommitted ones (an uncommitted
    key) compiled reset and step a second time, the step's second compilation inside the timed training."""
    for _ in range(2):
        pendulum.reset()
        for _ in range(3):
            pendulum.step(torch.zeros(4, 1))
    assert pendulum._reset._cache_size() == 1 and pendulum._step._cache_size() == 1


def test_jax_starts_after_its_environment_variables_and_says_nothing():
    """JAX is imported after the variables it reads are set, and start-up prints nothing that is not the user's
    business: no "Failed to import warp" (MuJoCo's optional GPU backend), no unmaintained-Brax/JAXopt warnings."""
    code = ("import os, sys; import ppo_mujoco_brax as B; assert 'jax' not in sys.modules; _, envs = B.import_brax(); "
            "envs.get_environment('inverted_pendulum'); "
            "print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'], os.environ.get('MUJOCO_GL'))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_PYTHON_CLIENT_PREALLOCATE", "MUJOCO_GL")}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    gl = "egl" if ctypes.util.find_library("EGL") else "None"
    assert result.returncode == 0 and result.stdout == f"false {gl}\n" and result.stderr == "", (
        result.stdout + result.stderr
    )
    # a machine without libEGL (an H100 machine's did not have it): MUJOCO_GL=egl would fail MuJoCo's import
    no_egl = code.replace("import ppo_mujoco_brax", "import ctypes.util; ctypes.util.find_library = lambda name: None; "
                          "import ppo_mujoco_brax")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", no_egl], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.splitlines()[-1].split() == ["false", "None"], result.stderr[-2000:]


def test_termination_is_not_truncation():
    env = B.BraxVecEnv("inverted_pendulum", "spring", 16, 1000, "cpu", seed=0)  # as test_smoke_run's: one compilation
    env.reset()
    for _ in range(200):  # full force one way: the pole falls long before the time limit
        obs, reward, terminated, truncated, info = env.step(torch.ones(16, 1))
        if terminated.any():
            break
    assert terminated.all() and not truncated.any() and torch.all(info["episode_length"] < 1000)


def test_running_mean_std_matches_numpy_on_streamed_chunks():
    rng = np.random.default_rng(0)
    data = rng.normal(loc=[1.0, -3.0, 10.0], scale=[0.5, 2.0, 7.0], size=(10_000, 3))
    rms = B.RunningMeanStd((3,), epsilon=0.0)
    start = 0
    for size in rng.integers(1, 700, size=100):
        chunk = data[start : start + size]
        if len(chunk):
            rms.update(torch.as_tensor(chunk, dtype=torch.float32))
        start += size
    seen = data[:start]
    np.testing.assert_allclose(rms.mean.numpy(), seen.mean(0), rtol=1e-6)
    np.testing.assert_allclose(rms.var.numpy(), seen.var(0), rtol=1e-5)
    assert rms.count.item() == len(seen)
    z = rms.normalize(torch.as_tensor(seen[:5], dtype=torch.float32))
    np.testing.assert_allclose(z.numpy(), (seen[:5] - seen.mean(0)) / seen.std(0), rtol=1e-4, atol=1e-4)


def test_reward_scaler_scales_a_rollout_by_the_earlier_rollouts_statistics():
    """A rollout's rewards are divided by the std of the discounted returns of the earlier rollouts (at first
    the prior, 1), and its T x N returns join the statistics at its end: updated step by step, the first step
    of a run (every env has the same return) gave a std near 0 and rewards scaled ~1000x."""
    scaler = B.RewardScaler(num_envs=3, gamma=0.5, device="cpu")
    rewards = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    dones = torch.tensor([[False, True, False], [False, False, False]])
    first = torch.stack([scaler(reward, done) for reward, done in zip(rewards, dones)])
    torch.testing.assert_close(first, rewards)  # the prior: variance 1
    scaler.update()
    returns = np.array([1.0, 2.0, 3.0, 0.5 * 1 + 1, 0 + 1, 0.5 * 3 + 1])  # env 1's return restarts after its end
    prior, n = 1e-4, len(returns)  # RunningMeanStd's start: mean 0, variance 1, count 1e-4
    var = (prior + returns.var() * n + returns.mean() ** 2 * prior * n / (prior + n)) / (prior + n)
    np.testing.assert_allclose(scaler.return_rms.var.item(), var, rtol=1e-12)
    second = scaler(torch.ones(3), torch.zeros(3, dtype=torch.bool))
    torch.testing.assert_close(second, torch.full((3,), 1 / np.sqrt(var + 1e-8), dtype=torch.float32))


def test_normaliser_is_saved_with_the_model():
    agent = B.Agent(4, 1)
    agent.obs_rms.update(torch.randn(100, 4) * 3 + 1)
    copy = B.Agent(4, 1)
    copy.load_state_dict(agent.state_dict())
    torch.testing.assert_close(copy.obs_rms.mean, agent.obs_rms.mean)
    torch.testing.assert_close(copy.obs_rms.var, agent.obs_rms.var)


@pytest.mark.parametrize("trained_with, flags", [(True, {}), (False, {"norm_obs": "on"})])
def test_eval_only_normalises_observations_as_the_model_was_trained(trained_with, flags, in_tmp):
    """--eval-only --load-model follows the model, not its own --norm-obs: a model trained on normalised observations,
    evaluated on inverted_pendulum (where auto means raw), still normalises them, and a raw one stays raw under
    --norm-obs on. (The setting used to come from the evaluation's flags, with no warning.) A model saved without
    the setting is refused in one line."""
    agent = B.Agent(4, 1, norm_obs=trained_with)
    agent.obs_rms.update(torch.randn(100, 4) * 3 + 1)
    torch.save(agent.state_dict(), "model.cleanrl_model")
    args = B.Args(env_id="inverted_pendulum", num_envs=4, num_minibatches=4, episode_length=5, eval_episodes=4,
                  eval_only=True, load_model="model.cleanrl_model", device="cpu", **flags)  # fmt: skip
    loaded = B.train(args)
    obs = torch.randn(8, 4)
    torch.testing.assert_close(loaded.normalize(obs), agent.obs_rms.normalize(obs) if trained_with else obs)
    torch.save({k: v for k, v in agent.state_dict().items() if k != "norm_obs"}, "old.cleanrl_model")
    command = ["--env-id", "inverted_pendulum", "--num-envs", "4", "--num-minibatches", "4", "--episode-length",
               "5", "--eval-episodes", "4", "--eval-only", "--load-model", "old.cleanrl_model"]  # fmt: skip
    message = 'error: --load-model old.cleanrl_model does not fit this agent: Missing key(s) in state_dict: "norm_obs"'
    result = call_main("ppo_mujoco_brax", *command, cwd=in_tmp)
    # the model is checked against the agent, which needs the env's sizes: the note of its compilation comes first
    compiling = "note: JAX compiles inverted_pendulum's reset and step for 4 envs first (tens of seconds on a CPU)"
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 2 and lines[0] == compiling and message in lines[1], result.stderr


@pytest.mark.parametrize("env_id", ["inverted_pendulum", "inverted_double_pendulum", "hopper", "ant", "halfcheetah"])
def test_norm_obs_auto_leaves_the_pendulums_and_hopper_raw(env_id):
    raw = env_id in ("inverted_pendulum", "inverted_double_pendulum", "hopper")
    assert B.normalises_obs(B.Args(env_id=env_id)) is not raw
    assert B.normalises_obs(B.Args(env_id=env_id, norm_obs="on")) and not B.normalises_obs(
        B.Args(env_id=env_id, norm_obs="off")
    )


def test_gaussian_logprob_and_entropy():
    torch.manual_seed(0)
    agent = B.Agent(5, 3)
    with torch.no_grad():
        agent.actor_logstd.copy_(torch.tensor([-0.5, 0.0, 0.3]))
    obs, actions = torch.randn(7, 5), torch.randn(7, 3)
    logprob, entropy, value = agent(obs, actions)
    dist = torch.distributions.Normal(agent.actor_mean(obs), agent.actor_logstd.exp())
    torch.testing.assert_close(logprob, dist.log_prob(actions).sum(-1))
    torch.testing.assert_close(entropy, dist.entropy().sum(-1))
    assert value.shape == (7,)


def test_videos_are_filmed_on_their_own_env_and_leave_training_alone(in_tmp, monkeypatch, capsys):
    """--capture-video --video-interval 1 films an episode at every iteration on a separate 1-env copy of the env:
    the training envs' episodes and the reward scaling's discounted return go on, so training is the same as
    without videos, to the last bit. Each MP4 goes to W&B."""
    resets = []
    reset = B.BraxVecEnv.reset
    monkeypatch.setattr(B.BraxVecEnv, "reset", lambda self: resets.append(self) or reset(self))
    runs = fake_wandb(monkeypatch)
    # one env, as the video env: a single compilation for the whole test
    flags = dict(env_id="inverted_pendulum", num_envs=1, num_steps=8, num_minibatches=2, total_timesteps=24,
                 episode_length=5, eval_episodes=1, progress_bar=False, device="cpu")  # fmt: skip
    plain = B.train(B.Args(**flags))
    resets.clear()
    filmed = B.train(B.Args(**flags, capture_video=True, video_interval=1, track=True))

    training_envs = resets[0]  # train's own reset, before the first rollout
    assert sum(env is training_envs for env in resets) == 1, "training envs reset other than at the start"
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, filmed.state_dict()[name]), name
    plain_run, filmed_run = sorted(glob.glob(str(in_tmp / "runs" / "*")))
    summaries = [read_json(os.path.join(run, "summary.json")) for run in (plain_run, filmed_run)]
    for key in ("total_env_steps", "episodes", "mean_return_last_100", "eval_returns"):
        assert summaries[0][key] == summaries[1][key], key
    films = ["training_iter00001", "training_iter00002", "training_iter00003", "evaluation"]
    mp4 = "no offscreen renderer for the MP4" not in capsys.readouterr().err  # where EGL or OSMesa works
    written = sorted(os.listdir(os.path.join(filmed_run, "videos")))
    assert written == sorted([f + ".html" for f in films] + ([f + ".mp4" for f in films] if mp4 else []))
    uploaded = [(key, os.path.basename(path)) for data in runs[0].rows for key, path in data.items() if "video" in key]
    expected = [("videos/training", f + ".mp4") for f in films[:3]] + [("videos/evaluation", "evaluation.mp4")]
    assert uploaded == (expected if mp4 else [])


def test_evaluation_plays_eval_episodes_envs_not_as_many_as_training(monkeypatch, tmp_path):
    """The final evaluation steps `eval-episodes` new envs, not a copy of the training envs (2048 by default: ~290 s
    for ant on 2 cores, past the 5 minutes the other torchrun ranks wait at the barrier); filmed, it films its first
    episode on those envs (no 1-env copy to compile)."""
    resets = []
    reset = B.BraxVecEnv.reset
    monkeypatch.setattr(B.BraxVecEnv, "reset", lambda self: resets.append(self.num_envs) or reset(self))
    training_envs = types.SimpleNamespace(num_envs=16, device=torch.device("cpu"))
    args = B.Args(env_id="inverted_pendulum", num_envs=16, episode_length=5, eval_episodes=4)
    returns = B.evaluate(B.Agent(4, 1), training_envs, args, video=None)
    assert resets == [4] and returns == pytest.approx([5.0] * 4)  # the pole stays up for the 5 steps
    resets.clear()
    filmed = B.evaluate(B.Agent(4, 1), training_envs, args, video=str(tmp_path / "videos" / "evaluation.mp4"))
    assert resets == [4] and filmed == returns and (tmp_path / "videos" / "evaluation.html").is_file()


@pytest.mark.parametrize("env_id, normalised", [("inverted_pendulum", False), ("ant", True)])
def test_smoke_run(env_id, normalised, tmp_path):
    """main() in this process: the pendulum on the 16 envs whose compiled step the other tests and the evaluation
    reuse, and ant (8-dim actions); --norm-obs auto normalises ant's observations only. The command line from a fresh
    interpreter: the learning and torchrun tests, and the missing-brax case below."""
    result = call_main("ppo_mujoco_brax", "--env-id", env_id, "--num-envs", "16", "--num-steps", "10",
                       "--num-minibatches", "4", "--total-timesteps", "1600", "--eval-episodes", "16",
                       "--no-progress-bar", "--save-model", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = glob.glob(str(tmp_path / "runs" / f"{env_id}__ppo_mujoco_brax__1__*"))
    summary = read_json(os.path.join(run_dir, "summary.json"))
    assert set(summary) == SUMMARY_KEYS and summary["args"]["backend"] == "spring"
    assert summary["status"] == "completed" and summary["total_env_steps"] == 1600 and summary["mean_sps"] > 0
    assert len(summary["eval_returns"]) == 16 and glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    # JAX's silent compilations are announced: the training envs' at the start, the evaluation's at the end
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: JAX compiles {env_id}'s reset and step for 16 envs first (tens of seconds on a CPU)",
                     "note: evaluating the policy on 16 episodes"], result.stderr  # fmt: skip
    state = torch.load(os.path.join(tmp_path, summary["model_path"]))
    # 10 rollouts of 160 observations counted either way (an `if` would wait for a GPU), used only when normalised
    assert state["obs_rms.count"] >= 1600 and bool(state["norm_obs"]) == normalised


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--env-id", "cartpole"], "invalid choice 'cartpole' for argument '--env-id'. Expected one of ('ant',"),
        (["--backend", "physx"], "invalid choice 'physx' for argument '--backend'"),
        (["--norm-obs", "yes"], "invalid choice 'yes' for argument '--norm-obs'. Expected one of ('auto', 'on',"),
        (
            ["--num-envs", "10", "--num-steps", "3", "--num-minibatches", "4", "--eval-episodes", "0"],
            "--num-minibatches must be a divisor of --num-envs * --num-steps = 30, got 4",
        ),
        (["--num-envs", "0"], "--num-envs must be positive, got 0"),
    ],
)
def test_bad_flags_give_one_clear_line(flags, message, tmp_path):
    assert_one_error_line(call_main("ppo_mujoco_brax", *flags, cwd=tmp_path), message)


@pytest.mark.parametrize("flags", [dict(env_id="cartpole"), dict(backend="physx"), dict(norm_obs=True)])
def test_validate_checks_the_choices_of_args_built_in_code(flags):
    with pytest.raises(ValueError, match=f"--{next(iter(flags)).replace('_', '-')} must be one of "):
        B.Args(**flags)


def test_missing_brax_names_the_pip_command(tmp_path):
    result = run_script("ppo_mujoco_brax", cwd=tmp_path, timeout=120, hide="brax")
    message = "error: this script needs brax and jax: pip install brax==0.14.2 jax==0.9.2 jaxlib==0.9.2"
    assert_one_error_line(result, message)
    assert result.stderr.strip() == message


# the bar for robust learning (docs/ppo_mujoco_brax.md, "Across seeds"): a 100-episode mean of 900 within 2M steps
PENDULUM = ["--env-id", "inverted_pendulum", "--num-envs", "256", "--total-timesteps", "2000000",
            "--target-return", "900", "--eval-episodes", "16", "--no-progress-bar"]  # fmt: skip


def start_pendulum_runs(folder, batch: list[tuple[int, int]], start=subprocess.Popen) -> list[tuple]:
    """Train each (seed, torch threads) of the batch at once, each in a process of its own, in `folder`; returns
    [(seed, threads, log, process)]. The thread count is set: results depend on it (float reduction order)."""
    running = []
    for seed, threads in batch:
        flags = [*PENDULUM, "--seed", str(seed), "--torch-threads", str(threads), "--exp-name", f"t{threads}"]
        log = folder / f"t{threads}_{seed}.log"
        cmd = [sys.executable, os.path.join(ROOT, "ppo_mujoco_brax.py"), *flags]
        with open(log, "w") as out:  # the child keeps its own copy of the file descriptor
            running.append((seed, threads, log, start(cmd, cwd=folder, stdout=out, stderr=out)))
    return running


def failed_pendulum_runs(folder, running: list[tuple]) -> list[tuple]:
    """Waits for the runs; (seed, threads, 100-episode mean, evaluation) of those that did not reach the target or
    scored < 900 with the mean action."""
    failed = []
    for seed, threads, log, process in running:
        assert process.wait(timeout=3600) == 0, log.read_text()
        summary = read_json(glob.glob(str(folder / "runs" / f"*__t{threads}__{seed}__*" / "summary.json"))[0])
        if summary["status"] != "target return reached" or summary["eval_mean_return"] < 900:
            failed.append((seed, threads, summary["mean_return_last_100"], summary["eval_mean_return"]))
    return failed


def assert_pendulum_learned(tmp_path, batches: list[list[tuple[int, int]]]) -> None:
    """The batches one after another, each batch's runs at once; every run must learn."""
    failed = [run for batch in batches for run in failed_pendulum_runs(tmp_path, start_pendulum_runs(tmp_path, batch))]
    assert_none_failed(failed)


def assert_none_failed(failed: list[tuple]) -> None:
    assert not failed, f"(seed, threads, 100-episode mean, evaluation) of the failed runs: {failed}"


@pytest.mark.learning
@pytest.mark.started_early(
    start=lambda folder: start_pendulum_runs(folder, [(1, 1), (2, 1)], start=start_in_background)
)
def test_inverted_pendulum_is_learned_on_two_seeds(started_early):
    """Seeds 1 and 2 with one thread each (main's choice at 256 envs), started with the session in the background,
    where they take ~2 minutes of the other tests' idle time; the test, last, waits for them. Seed 1 stalled at a
    100-episode mean of ~715 before the discount of 0.99 and the per-rollout reward scaler; with normalised
    observations (before --norm-obs auto) seed 2 with two threads stalled at 462."""
    assert_none_failed(failed_pendulum_runs(*started_early))


@pytest.mark.slow  # 510 s on a 2-core Intel Xeon, against ~5 minutes for the two processes above side by side
def test_inverted_pendulum_is_learned_on_two_stacked_seeds(tmp_path):
    """Seeds 1 and 2 as `--num-seeds 2`, one process, one torch thread (main's choice at 256 envs): each seed's
    envs step in JAX in turn and their updates run stacked. Both must reach the target and score >= 900 with the
    mean action (2026-11-26: seed 1 at 1.03M steps, seed 2 at ~1.4M)."""
    flags = [*PENDULUM, "--num-seeds", "2", "--torch-threads", "1"]
    cmd = [sys.executable, os.path.join(ROOT, "ppo_mujoco_brax.py"), *flags]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stderr[-3000:]
    (group,) = glob.glob(str(tmp_path / "runs" / "*__1-2__*"))
    runs = [
        read_json(os.path.join(tmp_path, d, "summary.json"))
        for d in read_json(os.path.join(group, "summary.json"))["run_dirs"]
    ]
    failed = [(s["seed"], s["mean_return_last_100"], s["eval_mean_return"]) for s in runs
              if s["status"] != "target return reached" or s["eval_mean_return"] < 900]  # fmt: skip
    assert not failed, f"(seed, 100-episode mean, evaluation) of the failed seeds: {failed}"


@pytest.mark.slow
def test_inverted_pendulum_is_learned_on_five_seeds_with_one_and_two_threads(tmp_path):
    """Seeds 1-5, each with one and with two torch threads (24 minutes on 2 cores): all ten. With normalised
    observations seed 2 with two threads fell short (462 at 2M steps); with raw ones (--norm-obs auto) all ten
    reached 900 at 0.86-1.19M steps, each mean-action policy scoring 1000 (docs/ppo_mujoco_brax.md, "Across seeds")."""
    one_thread = [[(1, 1), (2, 1)], [(3, 1), (4, 1)], [(5, 1)]]
    assert_pendulum_learned(tmp_path, one_thread + [[(seed, 2)] for seed in range(1, 6)])
