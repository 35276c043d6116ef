"""The command lines of the CartPole scripts: outputs of a short run, clear errors, Ctrl-C, non-finite losses."""

import glob
import importlib
import os
import re
import signal
import subprocess
import sys
import time

import imageio_ffmpeg
import pytest
import torch

import ladder.outputs
import ppo_cartpole_gpu as P
from conftest import (
    ALL_SCRIPTS,
    ROOT,
    SCRIPTS,
    SUMMARY_KEYS,
    assert_one_error_line,
    call_main,
    import_script,
    interrupt_after_an_iteration,
    origin,
    read_json,
    run_script,
    scalar_tags,
)
from ladder.cli import parse_args
from ladder.flags import UsageError
from probes import Probe1

COMMON_TAGS = {"charts/episodic_return", "charts/episodic_length", "charts/SPS", "charts/learning_rate",
               "losses/policy_loss", "losses/entropy", "losses/total_loss", "eval/episodic_return"}  # fmt: skip
EXTRA_TAGS = {
    "ppo_cartpole_gpu": {"losses/value_loss", "losses/approx_kl", "losses/clipfrac", "losses/explained_variance"},
    "vpg": {"losses/value_loss", "losses/approx_kl", "losses/explained_variance"},
    "reinforce": set(),
}


def only_run_dir(root) -> str:
    runs = glob.glob(os.path.join(root, "runs", "*"))
    assert len(runs) == 1, runs
    return runs[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_run_writes_events_summary_video_model_and_wandb(script, tmp_path):
    result = run_script(script, "--total-timesteps", "6144", "--num-envs", "64", "--capture-video", "--video-interval",
                     "2", "--save-model", "--track", "--eval-episodes", "3", "--seed", "7", "--target-return", "None",
                     cwd=tmp_path, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    run_dir = only_run_dir(tmp_path)
    assert os.path.basename(run_dir).startswith(f"CartPole-v1__{script}__7__")
    assert COMMON_TAGS | EXTRA_TAGS[script] <= scalar_tags(run_dir)
    summary = read_json(os.path.join(run_dir, "summary.json"))
    assert set(summary) == SUMMARY_KEYS and summary["status"] == "completed"
    if script != "reinforce":  # whose rollouts end once every env has finished an episode
        assert summary["total_env_steps"] == summary["iterations"] * 64 * summary["args"]["num_steps"]
    assert 6144 <= summary["total_env_steps"] < 6144 + 64 * 500
    assert summary["wall_seconds"] > 0 and summary["mean_sps"] > 0 and summary["episodes"] >= 100
    # CartPole pays 1 per step and an episode lasts at least 8 steps; 6k steps of training cannot balance for long
    assert 8 <= summary["mean_return_last_100"] < 200
    assert (
        summary["solved_threshold"] == 475 and summary["solved_at_step"] is None and len(summary["eval_returns"]) == 3
    )
    assert summary["eval_mean_return"] == pytest.approx(sum(summary["eval_returns"]) / 3)
    assert "\r" not in result.stderr  # no progress bar where stderr is not a terminal: its redraws would fill a log
    result_line = result.stdout.strip().splitlines()[-1]
    assert result_line.startswith("completed: ") and f"outputs in {os.path.relpath(run_dir, tmp_path)}" in result_line
    # iterations 1, 3, 5, ...: a 4x4 grid video each, and one of the evaluation
    videos = sorted(glob.glob(os.path.join(run_dir, "videos", "training_*.mp4")))
    assert os.path.exists(os.path.join(run_dir, "videos", "evaluation.mp4"))
    assert os.path.exists(os.path.join(run_dir, "checkpoint.pt"))
    assert videos and os.path.basename(videos[0]) == "training_iter00001.mp4"
    assert all(os.path.basename(v) == f"training_iter{2 * i + 1:05d}.mp4" for i, v in enumerate(videos))
    assert os.path.getsize(videos[0]) > 1000
    module = importlib.import_module(script)
    agent = module.Agent(4, 2)
    agent.load_state_dict(torch.load(os.path.join(tmp_path, summary["model_path"])))
    assert glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*"))


def test_training_videos_film_whole_episodes_of_the_current_policy(tmp_path):
    """A training video films whole greedy episodes in 16 new envs, as the final evaluation does: one frame per step of
    the longest, not the rollout's 16 steps (0.32 s at 50 fps). Training's envs are left as they were."""
    agent, envs, args = P.Agent(4, 2), P.CartPole(32, "cpu", seed=5), P.Args(num_steps=16)
    agent.actor = torch.nn.Linear(4, 2, bias=False)  # push the way the pole turns: episodes of ~40-200 steps
    torch.nn.init.zeros_(agent.actor.weight)
    agent.actor.weight.data[:, 3] = torch.tensor([-1.0, 1.0])
    before = envs.state.clone()
    path = P.record_video(agent, envs, None, args, str(tmp_path / "videos" / "training_iter00001.mp4"))
    returns = P.evaluate(agent, envs, args, None, num_envs=16)
    assert imageio_ffmpeg.count_frames_and_secs(path)[0] == max(returns) > 16 and torch.equal(envs.state, before)


COMMON_BAD_FLAGS = [
    (["--num-envs", "0"], "--num-envs must be positive"),
    (["--total-timesteps", "-5"], "--total-timesteps must be "),
    (["--env-id", "MountainCar-v0"], "invalid choice 'MountainCar-v0' for argument '--env-id'. Expected one of ("),
    (["--num-envs", "many"], "error: --num-envs: invalid literal for int()"),
    (["--num-env", "3"], "unrecognized option --num-env; did you mean --num-envs?"),  # (was: "options: --num-env, 3")
    (["--lr", "0.001"], "unrecognized option --lr; did you mean --learning-rate?"),  # (was: --anneal-lr,)
    (["--no-progres-bar"], "unrecognized option --no-progres-bar; did you mean --no-progress-bar?"),
    (["--gamma", "1.5"], "--gamma must be in (0, 1]"),
    (["--learning-rate", "nan"], "--learning-rate must be > 0"),
    (["--learning-rate", "inf"], "--learning-rate must be finite, got inf"),  # a rule's "> 0" passes it: ladder's
    (["--device", "tpu7"], "--device"),
    (["--video-interval", "-1"], "--video-interval must be >= 0"),
    (["--seed", "99999999999999999999999"], "--seed must be in [0, 2,000,000,000]"),  # (was: torch's traceback)
    (["--exp-name", "a/b", "--save-model"], "--exp-name must be a name, not a path (no /), got a/b"),  # (traceback)
    (["--eval-only", "--load-model", "m.pt", "--eval-episodes", "0"], "--eval-only plays --eval-episodes (at least 1)"),
    (["--cuda", "False"], "unrecognized option --cuda; did you mean --device cuda?"),  # CleanRL's (was: --cuda-graph?)
    (["--capture-video", "True"], "--capture-video takes no value: --capture-video or --no-capture-video"),
]
SCRIPT_BAD_FLAGS = [
    (
        "ppo_cartpole_gpu",
        ["--num-envs", "10", "--num-steps", "3", "--num-minibatches", "4"],
        "--num-minibatches must be a divisor of --num-envs * --num-steps = 30, got 4",
    ),
    ("ppo_cartpole_gpu", ["--total-timesteps", "100"], "must be at least one rollout (2048 steps), got 100"),
    ("ppo_cartpole_gpu", ["--clip-coef", "0"], "--clip-coef must be > 0"),
    ("vpg", ["--rollout-use-count", "0"], "--rollout-use-count must be positive"),
    ("vpg", ["--clip-coef", "1.5"], "--clip-coef must be in (0, 1)"),
    ("reinforce", ["--num-steps", "100"], "--num-steps must be at least the episode limit 500, got 100"),
]


@pytest.mark.quick
@pytest.mark.parametrize(
    "script, flags, message",
    [(script, f, m) for script in SCRIPTS for f, m in COMMON_BAD_FLAGS] + SCRIPT_BAD_FLAGS,
)
def test_bad_flags_give_one_clear_line(script, flags, message, tmp_path):
    assert_one_error_line(call_main(script, *flags, cwd=tmp_path), message)
    assert not os.path.exists(tmp_path / "runs")


@pytest.mark.quick
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_bad_flag_is_one_line_from_a_fresh_interpreter(script, tmp_path):
    """As above, run as `python script.py`: nothing else reaches stderr, the imports' output included."""
    result = run_script(script, "--num-envs", "0", cwd=tmp_path, timeout=60)
    assert_one_error_line(result, "--num-envs must be positive")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.quick
@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_cuda_graph_is_on_by_default_in_every_script(script, monkeypatch):
    """--cuda-graph is the default of every script, Atari's included (its update is recorded on a fixed-size batch);
    on the CPU it changes nothing. --no-cuda-graph turns it off."""
    module = import_script(script)
    parse = lambda *flags: (monkeypatch.setattr(sys, "argv", [script, *flags]), parse_args(module.Args))[1]
    assert parse().cuda_graph
    assert not parse("--no-cuda-graph").cuda_graph


@pytest.mark.parametrize("seeds", [1, 2])
def test_without_a_terminal_progress_comes_as_plain_lines(seeds, in_tmp, monkeypatch):
    """Under nohup or in CI (stderr not a terminal) the bar is off and a plain line replaces it, every 30 s (here at
    every iteration): steps, SPS, time left, the recent return; with --num-seeds seed 1's, as the bar follows seed 1.
    --no-progress-bar silences it; before an episode has ended, the return is "none yet" (it was "nan (last 0)").
    Before, Atari printed nothing in 15 minutes."""
    monkeypatch.setattr(ladder.outputs, "PROGRESS_LINE_SECONDS", 0.0)
    flags = ["--num-envs", "32", "--total-timesteps", "2048", "--eval-episodes", "0", "--device", "cpu"]
    result = call_main("ppo_cartpole_gpu", *flags, "--num-seeds", str(seeds), cwd=in_tmp)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "/2,048 steps, " in line]
    assert len(lines) == 4, result.stderr  # an iteration is 32 x 16 steps
    pattern = ("seed 1: " if seeds > 1 else "") + r"[\d,]+/2,048 steps, ([\d,]+ SPS, \d\d:\d\d left|compiling), "
    assert all(re.fullmatch(pattern + r"return (none yet|-?[\d.]+ \(last \d+\))", line) for line in lines), lines
    assert "2,048/2,048 steps, " in lines[-1]
    first = call_main("ppo_cartpole_gpu", *flags, "--num-steps", "4", "--total-timesteps", "128", cwd=in_tmp)
    assert re.search(r"^128/128 steps, .*, return none yet$", first.stderr, re.M), first.stderr  # (none ends in 4)
    quiet = call_main("ppo_cartpole_gpu", *flags, "--no-progress-bar", "--exp-name", "quiet", cwd=in_tmp)
    assert " steps, " not in quiet.stderr


def test_a_run_past_its_total_shows_no_time_left(in_tmp, monkeypatch):
    """REINFORCE's rollout plays until every episode ends, past a --total-timesteps of 100: the line says 00:00 left
    (it said -00:00)."""
    monkeypatch.setattr(ladder.outputs, "PROGRESS_LINE_SECONDS", 0.0)
    flags = ["--num-envs", "8", "--total-timesteps", "100", "--eval-episodes", "0", "--device", "cpu"]
    result = call_main("reinforce", *flags, cwd=in_tmp)
    assert result.returncode == 0 and re.search(r"^[\d,]+/100 steps, [\d,]+ SPS, 00:00 left", result.stderr, re.M), (
        result.stderr
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_without_a_terminal_a_run_shows_signs_of_life_at_once(script, in_tmp):
    """Under nohup: a first line at once naming the run folder, the device and the steps, and a progress line after
    the first iteration (then one every 30 s: none more in a short run). Before, vpg was silent for 24 s and Atari
    for 45 s (ladder's outputs do this for all five scripts)."""
    steps = "12000" if origin(script) == "reinforce" else "2048"
    flags = ["--num-envs", "32", "--total-timesteps", steps, "--eval-episodes", "0", "--device", "cpu"]
    result = call_main(script, *flags, cwd=in_tmp)
    assert result.returncode == 0, result.stderr
    first, *rest = [line for line in result.stderr.splitlines() if not line.startswith("note: ")]
    assert re.fullmatch(r"runs/CartPole-v1__\w+__1__\d+: training on cpu, [\d,]+ steps", first), result.stderr
    assert len([line for line in rest if " steps, " in line]) == 1, result.stderr


@pytest.mark.quick
@pytest.mark.parametrize(
    "flag, missing",
    [("--capture-video", "imageio"), ("--capture-video", "imageio_ffmpeg"), ("--track", "wandb")],
)
def test_a_missing_package_a_flag_needs_is_one_line_before_the_run(flag, missing, tmp_path, monkeypatch):
    """--capture-video needs imageio and its ffmpeg (without it the first video raised imageio's ValueError mid-run,
    and one filmed only at the end lost the run's summary.json), --track wandb: one line naming the pip install,
    before a run folder is made."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    result = call_main("ppo_cartpole_gpu", flag, "--total-timesteps", "2048", cwd=tmp_path)
    package = missing.replace("_", "-")
    assert_one_error_line(result, f"{flag} needs {package}: pip install {package}==")
    assert not (tmp_path / "runs").exists()


def test_cuda_without_gpu_is_a_clear_error(tmp_path):
    result = run_script("ppo_cartpole_gpu", "--device", "cuda", cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: --device must be cpu, or cuda with a CUDA GPU per process (0 found, 1 needed), got cuda"
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_ctrl_c_writes_summary_and_model(script, tmp_path):
    flags = ["--total-timesteps", "100000000", "--save-model", "--target-return", "None", "--no-progress-bar"]
    result = interrupt_after_an_iteration([sys.executable, os.path.join(ROOT, script + ".py"), *flags], tmp_path,
                                          signal.SIGINT)  # fmt: skip
    stderr = result.stderr
    assert result.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    run_dir = only_run_dir(tmp_path)
    summary = read_json(os.path.join(run_dir, "summary.json"))
    assert summary["status"] == "interrupted" and summary["total_env_steps"] > 0
    assert os.path.exists(os.path.join(run_dir, f"{script}.cleanrl_model"))
    assert "charts/SPS" in scalar_tags(run_dir)


class NaNProbe(Probe1):
    def reward(self, action):
        return torch.full((self.num_envs,), float("nan"))


@pytest.mark.quick
@pytest.mark.parametrize("script", SCRIPTS)
def test_non_finite_loss_stops_the_run(script, in_tmp):
    module = importlib.import_module(script)
    args = module.Args(
        total_timesteps=4096, num_envs=64, num_steps=16, progress_bar=False, eval_episodes=0, save_model=True
    )
    with pytest.raises(FloatingPointError, match="non-finite loss at iteration 1"):
        module.train(args, envs=NaNProbe(64, "cpu"))
    summary = read_json(glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))[0])
    assert summary["status"] == "non-finite loss" and summary["model_path"] is None


@pytest.mark.quick
@pytest.mark.parametrize("target_kl, expected_calls", [(None, 2 * 4 * 4), (1e-9, 2 * 4)])
def test_target_kl_stops_the_epochs_early(target_kl, expected_calls, in_tmp, monkeypatch):
    calls = []
    real_loss = P.ppo_loss
    monkeypatch.setattr(P, "ppo_loss", lambda *a, **k: calls.append(1) or real_loss(*a, **k))
    args = P.Args(total_timesteps=2 * 64 * 16, num_envs=64, num_steps=16, num_minibatches=4, update_epochs=4,
                  target_kl=target_kl, progress_bar=False, eval_episodes=0)  # fmt: skip
    P.train(args)
    assert len(calls) == expected_calls


@pytest.mark.quick
@pytest.mark.parametrize("script", SCRIPTS)
def test_env_size_must_match_num_envs(script, in_tmp):
    module = importlib.import_module(script)
    with pytest.raises(ValueError, match="the env has 8 envs but --num-envs is 64"):
        module.train(module.Args(num_envs=64, num_steps=16, progress_bar=False), envs=Probe1(8, "cpu"))


@pytest.mark.quick
def test_a_float_flag_that_is_not_finite_is_refused_when_train_is_called_in_code(in_tmp):
    """As from the command line: a rule's "> 0" passes inf, ladder's check of every run's flags does not."""
    module = importlib.import_module("ppo_cartpole_gpu")
    with pytest.raises(UsageError, match="--learning-rate must be finite, got inf"):
        module.train(module.Args(learning_rate=float("inf"), progress_bar=False, device="cpu"))
    assert not os.path.exists(in_tmp / "runs")


# Setup failures: one line, a non-zero exit, nothing lost ---------------------------------------
SHORT = ["--num-envs", "8", "--num-steps", "16", "--total-timesteps", "256", "--eval-episodes", "0",
         "--no-progress-bar"]  # fmt: skip


def assert_one_failure_line(result, message: str) -> None:
    """A failure of the machine's, not a flag: exit code 1 and exactly one `error: ...` line, no traceback."""
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("  File ")], result.stderr


@pytest.mark.quick
def test_a_folder_the_run_cannot_write_ends_in_one_line(tmp_path):
    """An output folder that cannot be written (here a file where `runs/` goes: as root, a read-only folder would
    still be writable) ends in one line naming it. Before: a 39-line traceback (`Read-only file system`)."""
    (tmp_path / "runs").write_text("not a folder")
    result = call_main("ppo_cartpole_gpu", *SHORT, cwd=tmp_path)
    assert_one_failure_line(result, "error: [Errno 20] Not a directory: 'runs/CartPole-v1__ppo_cartpole_gpu__1__")


@pytest.mark.quick
def test_a_read_only_folder_is_the_error_said(tmp_path, monkeypatch):
    """A folder that refuses the run's folder (read-only, as a user's is): the line names that refusal. Before, the
    summary.json written at the end into the folder never made hid it: `[Errno 2] No such file or directory`."""
    real_makedirs = os.makedirs

    def makedirs(path, *args, **kwargs):  # (as root, chmod 555 refuses nothing)
        if str(path).startswith("runs"):
            raise PermissionError(13, "Permission denied", "runs")
        return real_makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)
    result = call_main("ppo_cartpole_gpu", *SHORT, cwd=tmp_path)
    assert_one_failure_line(result, "error: [Errno 13] Permission denied: 'runs'")


def test_out_of_memory_ends_in_one_line(tmp_path, monkeypatch):
    """The envs or the rollout too large for the memory (CPU or GPU): one line, not torch's traceback."""
    module = import_script("ppo_cartpole_gpu")
    message = "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to"

    def make_envs(*args):
        raise RuntimeError(message)

    monkeypatch.setattr(module, "make_envs", make_envs)
    result = call_main("ppo_cartpole_gpu", *SHORT, cwd=tmp_path)
    assert_one_failure_line(result, "error: out of memory ([enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAll")


def test_track_without_a_wandb_login_ends_in_one_line(tmp_path):
    """--track with no W&B login (no key, no netrc) ends in one line saying how: `wandb login` or offline, and leaves
    no run folder (it left an empty one). Before: a 35-line traceback (`No API key configured`)."""
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": "", "WANDB_MODE": "online", "WANDB_DIR": str(tmp_path)}
    result = run_script("ppo_cartpole_gpu", *SHORT, "--track", cwd=tmp_path, env=env, timeout=120)
    assert_one_error_line(result, "--track: No API key configured. Use `wandb login` to log in. (or WANDB_MODE=offline")
    assert not (tmp_path / "runs").exists()


def test_a_full_disk_at_a_checkpoint_keeps_the_last_one_and_ends_in_one_line(in_tmp, monkeypatch):
    """The disk fills while iteration 3's checkpoint is written: the run ends in one line, and iteration 2's
    checkpoint is still there and resumes."""
    import ladder.checkpoint

    saves, real_save = [], torch.save

    def save(obj, f, *args, **kwargs):
        saves.append(f)
        if len(saves) == 3:  # half a file written, then the disk is full
            f.write(b"partial")
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ladder.checkpoint.torch, "save", save)
    result = call_main("ppo_cartpole_gpu", *SHORT[:4], "--total-timesteps", "640", "--checkpoint-interval", "1",
                       "--eval-episodes", "0", "--no-progress-bar", cwd=in_tmp)  # fmt: skip
    assert_one_failure_line(result, "error: [Errno 28] No space left on device")
    monkeypatch.undo()
    folder = only_run_dir(in_tmp)
    saved = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)
    assert saved["counters"]["iteration"] == 2
    resumed = call_main("ppo_cartpole_gpu", "--resume", folder, cwd=in_tmp)
    assert resumed.returncode == 0, resumed.stderr


def test_filming_is_not_training_time(in_tmp, monkeypatch):
    """--capture-video's videos during training are not counted in wall_seconds or SPS. Each video here takes 1,000 s
    on the clock the run reads (a fake film moves it on, so a busy machine cannot sway the test): three of them, and
    the run's training time stays below one. Before, filming raised a run's training time from 1.6 to 11.5 s."""
    import ladder.seed

    clock, offset = time.perf_counter, [0.0]

    def film(self, record_video, rollout):
        offset[0] += 1000

    monkeypatch.setattr(time, "perf_counter", lambda: clock() + offset[0])
    monkeypatch.setattr(ladder.seed.Seed, "film", film)
    args = P.Args(num_envs=32, total_timesteps=32 * 16 * 3, eval_episodes=0, progress_bar=False, device="cpu",
                  capture_video=True, video_interval=1, target_return=None)  # fmt: skip
    P.train(args)
    (summary,) = [read_json(path) for path in glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))]
    assert offset[0] == 3000 and summary["iterations"] == 3 and summary["wall_seconds"] < 1000, summary
    assert summary["mean_sps"] > summary["total_env_steps"] / 1000, summary


def test_help_into_a_pipe_the_reader_closed_says_nothing(tmp_path):
    """`--help | head -1`: the reader stops reading, and the script ends quietly. Before: a last line
    `error: [Errno 32] Broken pipe` and exit 1, as if the run had failed."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "ppo_cartpole_gpu.py"), "--help"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    proc.stdout.close()  # before the help is written: its first write finds no reader
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0 and err == "", err


def test_a_run_whose_reader_goes_away_trains_on_to_its_end(tmp_path):
    """`python ppo_cartpole_gpu.py 2>&1 | head -1`: the reader goes after the first line, and the run trains on to its
    end, its outputs whole. Before: the next line's write ended it, mid-training, as an error and with no checkpoint
    (a user's trial, Atari's and CartPole's)."""
    flags = ["--num-envs", "32", "--total-timesteps", "8192", "--eval-episodes", "2", "--checkpoint-interval", "0"]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "ppo_cartpole_gpu.py"), *flags], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    assert ": training on cpu" in proc.stdout.readline()  # (no terminal: the progress line)
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0
    (folder,) = glob.glob(str(tmp_path / "runs" / "*"))
    summary = read_json(os.path.join(folder, "summary.json"))
    assert summary["status"] == "completed" and len(summary["eval_returns"]) == 2, summary
    assert os.path.exists(os.path.join(folder, "checkpoint.pt"))


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs SIGTERM")
def test_sigterm_before_the_run_starts_ends_in_one_line(tmp_path):
    """A SIGTERM while `train()` sets up, before `run.start` installs the run's handlers (Brax's JAX set-up takes
    seconds): `interrupted by SIGTERM`, exit 143. Before: killed by the signal, without a word."""
    code = f"""
import sys, time
sys.path.insert(0, {ROOT!r})
import ppo_cartpole_gpu as P
from ladder.cli import run_command_line
def train(args):
    print("setting up", flush=True)
    time.sleep(600)
run_command_line(P.Args, train)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline() == "setting up\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM and err == "interrupted by SIGTERM\n", err


def test_resuming_a_folder_that_refuses_writes_ends_in_one_line(tmp_path):
    """--resume of a run folder on a read-only file system (a user's trial; emulated, as root writes anyway): one
    line naming it (the folder, not the probe's temporary file in it: a user's trial). Before: TensorBoard's writer
    threads' tracebacks around the line."""
    assert call_main("ppo_cartpole_gpu", *SHORT, cwd=tmp_path).returncode == 0
    (folder,) = glob.glob(str(tmp_path / "runs" / "*"))
    code = f"""
import builtins, io, os, sys
sys.path.insert(0, {ROOT!r})
import ppo_cartpole_gpu as P
refused = lambda path: os.path.abspath(os.fsdecode(path)).startswith({folder!r})
real_open, real_os_open = builtins.open, os.open
def open_(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, bytes)) and set(mode) & set("wax+") and refused(file) and "opener" not in kwargs:
        raise OSError(30, "Read-only file system", os.fsdecode(file))
    return real_open(file, mode, *args, **kwargs)
def os_open(path, flags, *args, **kwargs):
    if flags & os.O_TMPFILE == os.O_TMPFILE and refused(path):  # as where there is none: a named temporary file
        raise OSError(95, "Operation not supported", os.fsdecode(path))
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and refused(path):
        raise OSError(30, "Read-only file system", os.fsdecode(path))
    return real_os_open(path, flags, *args, **kwargs)
builtins.open = io.open = open_
os.open = os_open
sys.argv[1:] = ["--resume", {folder!r}, "--total-timesteps", "512"]
P.main()
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert_one_failure_line(result, f"error: [Errno 30] Read-only file system: '{folder}'")
