"""Never lose a run: checkpoints, --resume, SIGTERM/SIGINT, and --eval-only on a saved model."""

import copy
import glob
import os
import pathlib
import signal
import subprocess
import sys
from dataclasses import replace

import imageio_ffmpeg
import pytest
import torch
import torch._dynamo

import ladder.seed
from conftest import (
    ROOT,
    SCRIPTS,
    assert_one_error_line,
    assert_same_scalars,
    call_main,
    import_script,
    interrupt_after_an_iteration,
    read_json,
    run_dir,
    run_script,
    scalars,
    small_args,
    stop_with_sigterm_at,
    stopped_and_resumed,
)
from ladder.cli import check_run_flags
from ladder.flags import UsageError


@pytest.mark.behaviour
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_stopped_run_resumed_equals_one_run(script, compile, in_tmp, monkeypatch):
    """Stopped by SIGTERM after 3 iterations and resumed, a run logs the same scalars at the same steps and ends
    with the same weights, evaluation and bookkeeping as one run straight through (the LR annealed over both),
    eager and with --compile. Before, a compiled run resumed took the first rate of the run at every step (its step
    held the optimizer's param group from before `run.start` replaced it), ending up to 0.47 away."""
    module = import_script(script)
    torch._dynamo.reset()  # each run compiles as a new process would
    whole, resumed, stopped = stopped_and_resumed(module, small_args(module, compile=compile), in_tmp, monkeypatch)
    assert stopped["status"] == "interrupted" and stopped["iterations"] == 3
    assert_same_scalars(run_dir(in_tmp, "cut"), run_dir(in_tmp, "whole"))  # first: it says where and what
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    a, b = (read_json(os.path.join(run_dir(in_tmp, n), "summary.json")) for n in ("whole", "cut"))
    for key in ("status", "total_env_steps", "iterations", "episodes", "mean_return_last_100", "solved_at_step",
                "eval_returns"):  # fmt: skip
        assert a[key] == b[key], key


def test_sigterm_while_compiling_stops_at_once(tmp_path):
    """--compile's first iteration compiles for seconds to minutes (96 s cold on a 2-core AMD EPYC): a SIGTERM then
    stops the run at once, exit 143, with its summary and no checkpoint (no iteration is whole to keep). Before, the
    run said "stopping after this iteration" and compiled on until the end of the iteration (94 s here)."""
    flags = ["--compile", "--total-timesteps", "100000", "--no-progress-bar", "--num-envs", "32"]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "ppo_cartpole_gpu.py"), *flags], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    for line in proc.stderr:  # the run says it compiles, with its handlers in place
        if "the first iteration compiles" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err
    assert "SIGTERM while compiling: stopping now" in err and "Traceback" not in err, err
    (folder,) = glob.glob(str(tmp_path / "runs" / "*"))
    summary = read_json(os.path.join(folder, "summary.json"))  # stopped within iteration 1: no time bound needed
    assert summary["status"] == "interrupted" and summary["iterations"] == 0, summary
    assert not os.path.exists(os.path.join(folder, "checkpoint.pt"))


def test_sigterm_leaves_a_checkpoint_and_exits_143(tmp_path):
    flags = ["--total-timesteps", "100000000", "--target-return", "None", "--checkpoint-interval", "0",
             "--no-progress-bar", "--num-envs", "32"]  # fmt: skip
    command = [sys.executable, os.path.join(ROOT, "ppo_cartpole_gpu.py"), *flags]
    result = interrupt_after_an_iteration(command, tmp_path, signal.SIGTERM)
    out, err = result.stdout, result.stderr
    assert result.returncode == 143, err
    assert "Traceback" not in err and "interrupted by SIGTERM" in err
    (folder,) = glob.glob(str(tmp_path / "runs" / "*"))
    summary = read_json(os.path.join(folder, "summary.json"))
    assert summary["status"] == "interrupted" and f"outputs in {os.path.relpath(folder, tmp_path)}" in out
    command = f"python {os.path.join(ROOT, 'ppo_cartpole_gpu.py')} --resume {os.path.relpath(folder, tmp_path)}"
    assert err.splitlines()[-1] == f"interrupted by SIGTERM, with a checkpoint; go on with: {command}", err  # whole
    saved = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)
    counters = saved["counters"]
    assert counters["iteration"] == summary["iterations"] > 0 and counters["global_step"] == summary["total_env_steps"]


def test_a_second_ctrl_c_stops_at_once_and_says_how_to_go_on_from_the_last_checkpoint(in_tmp, monkeypatch):
    """A Ctrl-C, then another amid the same iteration (4): the run stops at once, exit 130, and its last line is the
    command that goes on from the checkpoint of iteration 3 (before: `interrupted by SIGINT` alone), which resumes."""
    module = import_script("ppo_cartpole_gpu")
    real_log = module.Run.log

    def log(self, *args, **kwargs):
        if self.progress.iteration == 3 and not self.args.resume:
            self.signals.request(signal.SIGINT, None)  # the first Ctrl-C's handler
            os.kill(os.getpid(), signal.SIGINT)  # the second: KeyboardInterrupt here, before the iteration is logged
        return real_log(self, *args, **kwargs)

    monkeypatch.setattr(module.Run, "log", log)
    flags = ["--num-envs", "32", "--total-timesteps", "4096", "--no-progress-bar", "--eval-episodes", "0"]
    result = call_main("ppo_cartpole_gpu", *flags, "--checkpoint-interval", "1", cwd=in_tmp)
    (folder,) = [os.path.relpath(path, in_tmp) for path in glob.glob(str(in_tmp / "runs" / "*"))]
    command = f"python {os.path.join(ROOT, 'ppo_cartpole_gpu.py')} --resume {folder}"
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1] == f"interrupted by SIGINT; go on from its last checkpoint with: {command}"
    summary = read_json(os.path.join(in_tmp, folder, "summary.json"))
    assert summary["status"] == "interrupted" and summary["iterations"] == 3  # (4 was not logged)
    result = call_main("ppo_cartpole_gpu", "--resume", folder, cwd=in_tmp)
    steps = summary["total_env_steps"]
    assert result.returncode == 0 and f"resumed {folder} at step {steps:,}" in result.stderr, result.stderr


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one(tmp_path):
    """The third checkpoint is killed half-written: checkpoint.pt is still the second, whole."""
    code = f"""
import os, signal, sys, torch
sys.path.insert(0, {ROOT!r})
import ppo_cartpole_gpu as P
real_save, calls = torch.save, []
def save(obj, f, *args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
        f.write(b"PK half a checkpoint")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)
torch.save = save
P.train(P.Args(num_envs=32, num_steps=16, total_timesteps=32 * 16 * 10, checkpoint_interval=1, progress_bar=False,
               eval_episodes=0, device="cpu"))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr
    (folder,) = glob.glob(str(tmp_path / "runs" / "*"))
    saved = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)
    assert saved["counters"]["iteration"] == 2 and saved["script"] == "ppo_cartpole_gpu.py"


@pytest.mark.parametrize("script", SCRIPTS)
def test_eval_only_replays_the_final_evaluation_on_video(script, tmp_path):
    """--eval-only on the saved model (or the checkpoint) scores the same episodes as the training run's own
    evaluation, and its video has one frame per evaluated step (CartPole pays 1 a step: the longest return)."""
    train = call_main(script, "--total-timesteps", "20000", "--num-envs", "32", "--save-model", "--eval-episodes",
                      "4", "--exp-name", "trained", "--no-progress-bar", cwd=tmp_path)  # fmt: skip
    assert train.returncode == 0, train.stderr
    trained = read_json(os.path.join(run_dir(tmp_path, "trained"), "summary.json"))
    for model, name in ((trained["model_path"], "from_model"), (os.path.join(run_dir(tmp_path, "trained")), "")):
        if not name:  # a run folder's checkpoint
            model, name = os.path.join(model, "checkpoint.pt"), "from_checkpoint"
        runner = run_script if name == "from_model" else call_main  # a fresh interpreter once
        result = runner(script, "--eval-only", "--load-model", model, "--eval-episodes", "4", "--capture-video",
                        "--exp-name", name, "--num-envs", "32", cwd=tmp_path)  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert (
            result.stdout.strip().splitlines()[-1].startswith("evaluated: total_env_steps 0, ")
            and "eval_mean_return" in result.stdout
        )
        summary = read_json(os.path.join(run_dir(tmp_path, name), "summary.json"))
        assert summary["status"] == "evaluated" and summary["total_env_steps"] == 0
        folder = os.path.relpath(run_dir(tmp_path, name), tmp_path)  # said, not made silently
        seed = "seed 1" if name == "from_checkpoint" else "weights alone: --env-id CartPole-v1, --seed 1"
        assert f"note: --eval-only: evaluating {model} ({seed}) into a new run folder, {folder}" in result.stderr
        assert summary["eval_returns"] == trained["eval_returns"]
        video = os.path.join(run_dir(tmp_path, name), "videos", "evaluation.mp4")
        assert imageio_ffmpeg.count_frames_and_secs(video)[0] == max(summary["eval_returns"])
        assert not os.path.exists(os.path.join(run_dir(tmp_path, name), "checkpoint.pt"))


def test_resume_and_load_model_refuse_bad_input_in_one_line(tmp_path):
    trained = call_main("ppo_cartpole_gpu", "--total-timesteps", "4096", "--num-envs", "32", "--save-model",
                        "--eval-episodes", "0", "--no-progress-bar", cwd=tmp_path)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    (folder,) = glob.glob(str(tmp_path / "runs" / "*"))
    before = {f: os.path.getmtime(os.path.join(folder, f)) for f in os.listdir(folder)}
    (tmp_path / "corrupt.pt").write_bytes(open(os.path.join(folder, "checkpoint.pt"), "rb").read()[:500])
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "text.pt").write_text("hello")
    torch.save([1, 2], tmp_path / "list.pt")
    os.makedirs(tmp_path / "bad")
    (tmp_path / "bad" / "summary.json").write_text("{x")  # (a kill amid its writing)
    model = os.path.join(folder, "ppo_cartpole_gpu.cleanrl_model")
    older = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)  # as if by an older script version
    del older["agent"]["actor.0.bias"]
    torch.save(older, tmp_path / "older.pt")
    for script, flags, message in (
        ("ppo_cartpole_gpu", ["--resume", "runs/none"], "--resume runs/none: no such file or folder"),
        ("ppo_cartpole_gpu", ["--resume", "corrupt.pt"], "--resume corrupt.pt is not a readable checkpoint"),
        ("ppo_cartpole_gpu", ["--resume", "empty.pt"], "--resume empty.pt is not a readable checkpoint (not a torch"),
        ("ppo_cartpole_gpu", ["--resume", "text.pt"], "--resume text.pt is not a readable checkpoint (not a torch f"),
        ("ppo_cartpole_gpu", ["--resume", "list.pt"], "list.pt was written by something else (a list), not ppo_c"),
        ("ppo_cartpole_gpu", ["--resume", "bad"], "bad/summary.json is not a run's summary (not a JSON object)"),
        ("vpg", ["--resume", folder], "was written by ppo_cartpole_gpu.py, not vpg.py"),
        ("ppo_cartpole_gpu", ["--resume", folder, "--gamma", "0.9"],
         "--gamma must be the checkpoint's 0.99 (--resume may change only --total-timesteps, --target-return, "),
        ("ppo_cartpole_gpu", ["--resume", model], "holds weights only; evaluate them with --eval-only --load-model"),
        ("ppo_cartpole_gpu", ["--resume", "older.pt"], '--resume older.pt does not fit this agent: Missing key(s) in'),
        ("ppo_cartpole_gpu", ["--resume", folder], "the run has ended; to train on, raise --total-timesteps"),
        ("ppo_cartpole_gpu", ["--eval-only"], "--eval-only and --load-model PATH go together"),
        ("ppo_cartpole_gpu", ["--load-model", model], "--eval-only and --load-model PATH go together"),
        ("reinforce", ["--eval-only", "--load-model", model], f"--load-model {model} does not fit this agent"),
        ("reinforce", ["--eval-only", "--load-model", model], "keep no flags: the --env-id and network's flags are"),
        ("ppo_cartpole_gpu", ["--checkpoint-interval", "-1"], "--checkpoint-interval must be >= 0"),
    ):  # fmt: skip
        assert_one_error_line(call_main(script, *flags, cwd=tmp_path), message)
    assert glob.glob(str(tmp_path / "runs" / "*")) == [folder]  # no new run folder
    assert {f: os.path.getmtime(os.path.join(folder, f)) for f in os.listdir(folder)} == before  # nothing rewritten


def test_resume_takes_the_checkpoints_flags_and_may_extend_the_run(tmp_path):
    first = run_script("vpg", "--total-timesteps", "4096", "--num-envs", "32", "--learning-rate", "0.002",
                       "--eval-episodes", "0", "--no-progress-bar", "--exp-name", "mine", cwd=tmp_path)  # fmt: skip
    assert first.returncode == 0, first.stderr
    folder = run_dir(tmp_path, "mine")
    more = run_script("vpg", "--resume", folder, "--total-timesteps", "8192", cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    summary = read_json(os.path.join(folder, "summary.json"))
    assert summary["total_env_steps"] == 8192 and summary["iterations"] == 16
    assert summary["args"]["learning_rate"] == 0.002 and summary["args"]["num_envs"] == 32
    assert summary["args"]["exp_name"] == "mine" and glob.glob(str(tmp_path / "runs" / "*")) == [folder]
    steps = [step for step, _ in scalars(folder)["losses/total_loss"]]
    assert steps == sorted(set(steps)) and len(steps) == 16  # no step logged twice


# ---------------------------------------------------------------------------------------------
# Atari and Brax: their emulators are not ours to save; the agent, optimizer and statistics are
# ---------------------------------------------------------------------------------------------
def restored_state(module, args, monkeypatch):
    """Train `args`, then resume it for one rollout more; return (the checkpoint, the state dicts of all it holds and
    the counters as the resumed run's `start` left them, before that rollout)."""
    module.train(args)
    (folder,) = glob.glob(os.path.join("runs", "*"))
    saved = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)
    restored, real_start = {}, module.Run.start

    def start(self, *a, **k):
        obs = real_start(self, *a, **k)
        restored.update(
            {name: copy.deepcopy(obj.state_dict()) for name, obj in self.stateful.items() if name != "envs"}
        )
        restored["counters"] = self.progress.counters(0)
        return obs

    monkeypatch.setattr(module.Run, "start", start)
    more = args.total_timesteps + args.num_envs * args.num_steps
    module.train(replace(args, resume=folder, total_timesteps=more))
    return saved, restored


def assert_same_state(saved: dict, state: dict) -> None:
    if "state" in state:  # an optimizer: its moments and step (ladder's Adam: flat), and each group's settings
        for name, value in state["state"]["flat"].items():
            assert torch.equal(value.cpu(), saved["state"]["flat"][name]), name
        for group, saved_group in zip(state["param_groups"], saved["param_groups"], strict=True):
            for key, value in group.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(saved_group[key])), key
        return
    for name, value in state.items():
        assert torch.equal(value.cpu(), saved[name]), name


def test_atari_resume_restores_agent_and_optimizer(in_tmp, monkeypatch):
    A = import_script("ppo_atari_envpool")
    args = A.Args(env_id="Pong-v5", num_envs=4, num_steps=32, total_timesteps=4 * 32 * 2, progress_bar=False,
                  eval_episodes=0, device="cpu")  # fmt: skip
    saved, restored = restored_state(A, args, monkeypatch)
    assert saved["counters"]["iteration"] == restored["counters"]["iteration"] == 2
    assert saved["ranks"][0]["envs"] is None
    assert_same_state(saved["agent"], restored["agent"])
    assert_same_state(saved["optimizer"], restored["optimizer"])


def test_brax_resume_restores_agent_normaliser_optimizer_and_reward_scaler(in_tmp, monkeypatch):
    B = import_script("ppo_mujoco_brax")
    args = B.Args(env_id="inverted_pendulum", num_envs=16, num_steps=10, num_minibatches=4, norm_obs="on",
                  total_timesteps=16 * 10 * 2, progress_bar=False, eval_episodes=0, device="cpu")  # fmt: skip
    saved, restored = restored_state(B, args, monkeypatch)
    assert saved["counters"]["iteration"] == restored["counters"]["iteration"] == 2
    assert "obs_rms.mean" in saved["agent"] and saved["agent"]["obs_rms.count"] > 1  # the normaliser is in it
    assert_same_state(saved["agent"], restored["agent"])
    assert_same_state(saved["optimizer"], restored["optimizer"])
    assert_same_state(saved["reward_scaler"], restored["reward_scaler"])
    assert len(saved["ranks"][0]["envs"]["leaves"]) > 4  # the physics states, episode counters and random key


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_stopped_brax_run_resumed_equals_one_run(compile, in_tmp, monkeypatch):
    """Brax's envs save their physics states (every array of the state pytree), and the reward scaler its running
    returns: a run stopped after 3 iterations and resumed ends with one run's weights, bit for bit, eager and with
    --compile. Before, the resumed run reset every env and the scaler's returns, and the weights differed (by up to
    6e-4 here); compiled, it also kept the first learning rate."""
    B = import_script("ppo_mujoco_brax")
    args = B.Args(env_id="inverted_pendulum", num_envs=16, num_steps=10, num_minibatches=4, norm_obs="on",
                  total_timesteps=16 * 10 * 6, target_return=None, progress_bar=False, eval_episodes=0,
                  device="cpu", compile=compile)  # fmt: skip
    torch._dynamo.reset()
    whole, resumed, stopped = stopped_and_resumed(B, args, in_tmp, monkeypatch)
    assert stopped["iterations"] == 3
    assert_same_scalars(run_dir(in_tmp, "cut"), run_dir(in_tmp, "whole"))  # first: it says where and what
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name


def test_resume_on_another_number_of_torchrun_ranks_is_one_line(tmp_path, monkeypatch):
    """A checkpoint of one process resumed by two (or the other way round) would redo or skip steps and restart the
    envs: refused in one line before anything is built."""
    trained = call_main("ppo_cartpole_gpu", "--total-timesteps", "2048", "--num-envs", "32", "--eval-episodes", "0",
                        "--no-progress-bar", cwd=tmp_path)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    (folder,) = glob.glob(str(tmp_path / "runs" / "*"))
    P = import_script("ppo_cartpole_gpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="the checkpoint is of 1 torchrun ranks; resume it with one process, python"):
        check_run_flags(P.Args(num_envs=32, total_timesteps=4096, resume=folder))
    monkeypatch.delenv("WORLD_SIZE")  # and two ranks' checkpoint resumed by one process
    saved = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)
    torch.save(saved | {"ranks": saved["ranks"] * 2}, os.path.join(folder, "checkpoint.pt"))
    with pytest.raises(UsageError, match="of 2 torchrun ranks; resume it with torchrun --nproc-per-node 2"):
        check_run_flags(P.Args(num_envs=32, total_timesteps=4096, resume=folder))


def test_a_resume_that_fails_leaves_the_interrupted_runs_outputs(in_tmp, monkeypatch):
    """A resume that fails while restoring writes nothing: the stopped run's summary.json and checkpoint stay."""
    P = import_script("ppo_cartpole_gpu")
    args = small_args(P)
    stop_with_sigterm_at(P, monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        P.train(args)
    folder = run_dir(in_tmp, args.exp_name)
    before = {f: pathlib.Path(folder, f).read_bytes() for f in ("summary.json", "checkpoint.pt")}

    def broken(envs, saved):
        raise RuntimeError("this env cannot take that state")

    monkeypatch.setattr(P.CartPole, "load_state_dict", broken)
    with pytest.raises(RuntimeError, match="this env cannot take that state"):
        P.train(replace(args, resume=folder))
    assert {f: pathlib.Path(folder, f).read_bytes() for f in before} == before


def test_the_envs_state_is_saved_on_the_cpu(in_tmp):
    """`CartPole.state_dict` moves the envs' tensors to the CPU before they are gathered and saved (under NCCL a CUDA
    tensor of rank r would be rebuilt on cuda:r in rank 0). A tensor subclass stands in for a CUDA tensor where no GPU
    is lent; and the checkpoint holds what `state_dict` gave."""
    P = import_script("ppo_cartpole_gpu")

    class OnTheGPU(torch.Tensor):
        def cpu(self):
            return torch.Tensor.cpu(self).as_subclass(torch.Tensor)

    envs = P.CartPole(8, "cpu", seed=0)
    envs.state, envs.episode_return = envs.state.as_subclass(OnTheGPU), envs.episode_return.as_subclass(OnTheGPU)
    assert all(type(value) is torch.Tensor for value in envs.state_dict().values())
    P.train(replace(small_args(P), eval_episodes=0))
    saved = torch.load(os.path.join(run_dir(in_tmp, "ppo_cartpole_gpu"), "checkpoint.pt"), weights_only=True)
    assert sorted(saved["ranks"][0]["envs"]) == ["episode_length", "episode_return", "generator", "seed", "state"]


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs SIGTERM")
def test_a_signal_during_the_final_evaluation_ends_it_and_the_outputs_are_written(tmp_path):
    """SIGTERM (e.g. torchrun shutting down) while the final evaluation runs: the evaluation stops, summary.json and
    the checkpoint are still written, and the run ends normally (before: killed, no summary.json)."""
    code = f"""
import os, signal, sys, time
sys.path.insert(0, {ROOT!r})
import ppo_cartpole_gpu as P
def evaluate(*args):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(3600)
P.evaluate = evaluate
P.train(P.Args(num_envs=32, num_steps=16, total_timesteps=32 * 16 * 2, progress_bar=False, device="cpu"))
print("returned")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "returned" in result.stdout, result.stderr
    (folder,) = glob.glob(str(tmp_path / "runs" / "*"))
    summary = read_json(os.path.join(folder, "summary.json"))
    assert summary["status"] == "completed" and summary["iterations"] == 2 and summary["eval_returns"] is None
    assert torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)["counters"]["iteration"] == 2


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs SIGTERM")
def test_a_signal_during_an_eval_only_run_interrupts_it(tmp_path):
    """--eval-only's evaluation is the run: SIGTERM in it leaves summary.json with status interrupted, says so and exits
    143. Before, the cut evaluation ended as "evaluated" with no returns and exit 0, as if it had played them."""
    code = f"""
import glob, os, signal, sys, time
sys.path.insert(0, {ROOT!r})
import ppo_cartpole_gpu as P
P.train(P.Args(num_envs=32, num_steps=16, total_timesteps=32 * 16, progress_bar=False, device="cpu", save_model=True,
               eval_episodes=0, exp_name="trained"))
def evaluate(*args):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(3600)
P.evaluate = evaluate
sys.argv[1:] = ["--eval-only", "--load-model", glob.glob("runs/*/trained.cleanrl_model")[0], "--exp-name", "evaluated"]
P.main()
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 128 + signal.SIGTERM and "interrupted by SIGTERM" in result.stderr, result.stderr
    (folder,) = glob.glob(str(tmp_path / "runs" / "*__evaluated__*"))
    summary = read_json(os.path.join(folder, "summary.json"))
    assert summary["status"] == "interrupted" and summary["eval_returns"] is None
    assert result.stdout.splitlines()[-1].startswith("interrupted: total_env_steps 0"), result.stdout


def test_eval_only_of_a_checkpoint_takes_its_seed_and_env(tmp_path):
    """--eval-only of seed 2's checkpoint of EasyCart-v1, --seed and --env-id left out: the new folder and the
    evaluation are seed 2's on EasyCart-v1 (the same returns as the run's own final evaluation). Before, the folder was
    named __1__ and the episodes were seed 1's, and CartPole-v1's (a user's trial). A bare model (`--save-model`'s
    weights) keeps no flags: its folder is --seed's and --env-id's, and the note says so."""
    train = call_main("ppo_cartpole_gpu", "--seed", "2", "--total-timesteps", "4096", "--num-envs", "32", "--env-id",
                      "EasyCart-v1", "--gamma", "0.98", "--eval-episodes", "3", "--exp-name", "trained",
                      "--no-progress-bar", "--save-model", cwd=tmp_path)  # fmt: skip
    assert train.returncode == 0, train.stderr
    trained = read_json(os.path.join(run_dir(tmp_path, "trained"), "summary.json"))
    result = call_main("ppo_cartpole_gpu", "--eval-only", "--load-model", run_dir(tmp_path, "trained"),
                       "--eval-episodes", "3", "--exp-name", "evaluated", "--num-envs", "32", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "__evaluated__2__" in run_dir(tmp_path, "evaluated") and "(seed 2) into a new run folder" in result.stderr
    evaluated = read_json(os.path.join(run_dir(tmp_path, "evaluated"), "summary.json"))
    assert evaluated["seed"] == 2 and evaluated["eval_returns"] == trained["eval_returns"]
    assert evaluated["env_id"] == "EasyCart-v1" and evaluated["args"]["gamma"] == 0.98
    bare = call_main("ppo_cartpole_gpu", "--eval-only", "--load-model", trained["model_path"], "--eval-episodes", "3",
                     "--exp-name", "bare", "--num-envs", "32", cwd=tmp_path)  # fmt: skip
    assert bare.returncode == 0, bare.stderr
    assert "CartPole-v1__bare__1__" in run_dir(tmp_path, "bare"), bare.stderr
    assert "(weights alone: --env-id CartPole-v1, --seed 1)" in bare.stderr


def test_every_scalar_before_a_checkpoint_is_on_disk_when_it_is_written(in_tmp, monkeypatch):
    """A run killed (SIGKILL: no handler runs) after a checkpoint and resumed logs on from the checkpoint's step, so the
    scalars of the steps before it must be on disk by then: a user's trial found a gap in the resumed curves (the rows
    of up to 10 s, and what TensorBoard's writer holds for up to 120 s, were not written yet)."""
    module, on_disk, real_save = import_script("ppo_cartpole_gpu"), [], ladder.seed.Seed.save

    def save(self, note):
        on_disk.append((self.progress.global_step, scalars(self.dir)["losses/value_loss"][-1][0]))
        real_save(self, note)

    monkeypatch.setattr(ladder.seed.Seed, "save", save)
    module.train(small_args(module, eval_episodes=0, checkpoint_interval=2))
    assert len(on_disk) >= 3 and all(step == logged for step, logged in on_disk), on_disk


def test_a_summary_cut_short_in_its_writing_leaves_the_one_before(in_tmp, monkeypatch):
    """summary.json is written as checkpoint.pt is, through a file renamed when whole: a run resumed, whose new
    summary fails amid its writing, leaves the last one readable. Before, a half-written summary.json, which the next
    --resume refused as not a run's summary."""
    module = import_script("ppo_cartpole_gpu")
    module.train(small_args(module, eval_episodes=0, exp_name="first"))
    real_asdict = ladder.seed.asdict
    monkeypatch.setattr(ladder.seed, "asdict", lambda args: real_asdict(args) | {"z": object()})  # no JSON for it
    more = small_args(module, eval_episodes=0, total_timesteps=16 * 32 * 8, resume=run_dir(in_tmp, "first"))
    with pytest.raises(TypeError, match="not JSON serializable"):
        module.train(more)
    summary = read_json(os.path.join(run_dir(in_tmp, "first"), "summary.json"))
    assert summary["status"] == "completed" and summary["iterations"] == 6, summary
