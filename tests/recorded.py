"""Runs recorded at a baseline commit: the scalars each script's defaults logged, and a checkpoint a stopped run left,
so that tests/test_layout.py can check that a change to the machinery changes nothing a run writes. Recorded with

    python tests/recorded.py        # writes tests/data/recorded_<BASELINE>.json and tests/data/ppo_stopped_<BASELINE>/

on a 2-core AMD EPYC, one torch thread (`record` runs whatever code is checked out: rerun it only to record a new
baseline, in a commit of its own that says why). The runs are short (a few iterations) and on the CPU.

Baselines: 1fff926 (issue 45, before the machinery moved into ladder/); 8e5a547 (issue 56: ladder's flat Adam, the
noise of K seeds drawn in one call, argsort permutations and REINFORCE's masked batch changed the numbers); 64108f6
(issue 57: Atari's batch keeps its reset steps, masked, so its minibatches split other rows; the other scripts'
scalars came out as at 8e5a547); 7d5ec2e (issue 65: the gradient clipped by clip_grad_norm_, whose norm of
per-parameter norms rounds otherwise than the flat vector's norm: Atari's policy loss moved by 1.3e-5, the other
scripts' scalars within the tolerance). The 1fff926 checkpoint stays, as a checkpoint of the format before ladder's
Adam, which a resume refuses in one line; the 64108f6 one, as the flat Adam's state before torch's state_dict, which
a resume still reads."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
BASELINE = "7d5ec2e"
SCALARS = os.path.join(DATA, f"recorded_{BASELINE}.json")
STOPPED = os.path.join(DATA, f"ppo_stopped_{BASELINE}")
"""The run folder (its checkpoint.pt and summary.json) of PPO's `RESUMED` run stopped after iteration 2."""
OLD_FORMAT = os.path.join(DATA, "ppo_stopped_1fff926")
"""The same, written before ladder's flat Adam: its optimizer state is torch's Adam's, per parameter."""
FLAT_BEFORE_STATE_DICT = os.path.join(DATA, "ppo_stopped_64108f6")
"""The same, written by ladder's flat Adam before its state_dict was torch's (the moments at "state" itself)."""

# Each script's defaults, seed 1, for a few iterations (REINFORCE: rollouts). Brax on inverted_pendulum with 16 envs
# rather than ant with 2,048: the same code, without ant's 80 s of JAX compilation on a CPU (16 envs: the evaluation's
# 16 reuse the training envs' compilation).
CONFIGS = {
    "ppo_cartpole_gpu": dict(iterations=3),
    "vpg": dict(iterations=3),
    "reinforce": dict(iterations=3),
    "ppo_atari_envpool": dict(iterations=1),
    "ppo_mujoco_brax": dict(iterations=2, env_id="inverted_pendulum", num_envs=16),
    "ppo_cartpole_gpu --num-seeds 2": dict(iterations=3, num_seeds=2),
    "ppo_cartpole_gpu --compile": dict(iterations=3, compile=True),
}
RESUMED = dict(num_envs=32, num_steps=16, total_timesteps=32 * 16 * 4, checkpoint_interval=0, eval_episodes=3)
"""PPO, 4 iterations: straight through, and stopped by SIGTERM after iteration 2 (the checkpoint kept)."""


def script_of(config: str) -> str:
    return config.split()[0]


def args_of(module, config: str, **flags):
    """The config's Args: the defaults, with the config's changes, on the CPU, without a progress bar."""
    settings = dict(CONFIGS[config])
    iterations = settings.pop("iterations")
    args = module.Args(device="cpu", progress_bar=False, **settings | flags)
    return replace(args, total_timesteps=iterations * args.num_envs * args.num_steps)


def scalars(run_dir: str) -> dict[str, list[list[float]]]:
    """Every scalar a run folder's event files hold, SPS aside (a clock), by tag: [step, value] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if tag != "charts/SPS"]
    return {tag: sorted([e.step, e.value] for e in events.Scalars(tag)) for tag in tags}


def folders(cwd: str) -> list[str]:
    """The run folders under `cwd`/runs, an aggregate folder of --num-seeds (no events) left out, in name order."""
    return sorted(d for d in glob.glob(os.path.join(cwd, "runs", "*")) if glob.glob(os.path.join(d, "events.*")))


def in_folder(cwd: str, fn, *args):
    """`fn(*args)` run in `cwd` with one torch thread (Atari's convolutions round by the thread count)."""
    threads, here = torch.get_num_threads(), os.getcwd()
    torch.set_num_threads(1)
    os.chdir(cwd)
    try:
        return fn(*args)
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)


def run_config(module, config: str, cwd: str) -> list[dict]:
    """Train the config in `cwd`; the scalars of each run folder (a seed each)."""
    in_folder(cwd, module.train, args_of(module, config))
    return [scalars(d) for d in folders(cwd)]


def record() -> None:  # run by hand, on the code the runs are to be recorded of (BASELINE)
    import importlib

    sys.path.insert(0, ROOT)
    recorded = {}
    for config in CONFIGS:
        module = importlib.import_module(script_of(config))
        if hasattr(module, "import_brax"):
            module.import_brax()
        with tempfile.TemporaryDirectory() as cwd:
            recorded[config] = run_config(module, config, cwd)
    ppo = importlib.import_module("ppo_cartpole_gpu")
    with tempfile.TemporaryDirectory() as cwd:
        in_folder(cwd, ppo.train, ppo.Args(device="cpu", progress_bar=False, exp_name="whole", **RESUMED))
        recorded["resumed: one run"] = [scalars(folders(cwd)[0])]
        real_log = ppo.Run.log

        def log(self, *args, **kwargs):  # SIGTERM while iteration 2 is logged: the run stops after it
            if self.progress.iteration == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return real_log(self, *args, **kwargs)

        ppo.Run.log = log
        try:
            in_folder(cwd, ppo.train, ppo.Args(device="cpu", progress_bar=False, exp_name="cut", **RESUMED))
        except KeyboardInterrupt:
            pass
        finally:
            ppo.Run.log = real_log
        (cut,) = glob.glob(os.path.join(cwd, "runs", "*__cut__*"))
        shutil.rmtree(STOPPED, ignore_errors=True)
        os.makedirs(STOPPED)
        for name in ("checkpoint.pt", "summary.json"):
            shutil.copy(os.path.join(cut, name), STOPPED)
    with open(SCALARS, "w") as f:
        json.dump(recorded, f, indent=1)


if __name__ == "__main__":
    record()
