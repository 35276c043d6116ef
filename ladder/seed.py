"""One seed's run: its folder, checkpoint and resume, evaluations, videos and end (model, summary.json, result)."""

import contextlib
import math
import os
import signal
import tempfile
from dataclasses import asdict, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ladder.checkpoint import load_in_place, read_checkpoint, state, write_atomically
from ladder.distributed import alike, broadcast_from_rank_0, load_ranks_own, rank_0s, ranks_apart
from ladder.flags import UsageError
from ladder.outputs import Outputs
from ladder.progress import Progress
from ladder.signals import interrupt


class Seed:
    """Seed `index`'s run under its own `args` (resumable alone); its counters are row `index` of `progress`. In
    `own()` its objects hold its own state (the last seed's are the lead's, which otherwise hold all K's)."""

    def __init__(self, index: int, args, script: str, progress: Progress, rank: int, world_size: int, started: int):
        self.index, self.args, self.script, self.progress = index, args, script, progress
        self.rank, self.world_size = rank, world_size
        self.saved = read_checkpoint(args.resume, script) if args.resume else None
        self.model = read_checkpoint(args.load_model, script, "--load-model") if args.load_model else None
        if args.eval_only and "args" in self.model:  # a checkpoint's: its folder and evaluation take its seed
            args = self.args = replace(args, seed=self.model["args"]["seed"])
        resumed = args.resume and (args.resume if os.path.isdir(args.resume) else os.path.dirname(args.resume) or ".")
        self.dir = resumed or new_folder(f"{args.env_id}__{args.exp_name}__{args.seed}", started)
        self.outputs, self.eval_returns, self.own = None, None, contextlib.nullcontext
        self.checkpointed, self.next_check, self.noted_apart, self.says_result = -1, 0, set(), True

    def open(self, objects: dict, per_rank: set, obs, total_steps: int, note):
        """`objects` loaded from --load-model or --resume, rank 0's outputs opened; returns the envs' observation."""
        self.objects, self.per_rank, self.total_steps, saved, a = objects, per_rank, total_steps, self.saved, self.args
        groups = zip(saved["optimizer"]["param_groups"] if saved else [], objects["optimizer"].param_groups)
        unnoted = ("params", "lr", "capturable")  # the rate: the flag's, annealed; capturable: ladder's Adam's own
        for theirs, group in groups:
            for key in [k for k, v in theirs.items() if k in group and k not in unnoted and group[k] != v]:
                note(f"the checkpoint's optimizer {key} {theirs[key]} replaces the code's {group[key]}")
        try:  # --load-model: a checkpoint's agent or a saved model; --resume: all that `save` wrote
            if self.model is not None:
                objects["agent"].load_state_dict(self.model.get("agent", self.model))
            for name, obj in kept(objects).items() if saved is not None else ():
                ranks = saved["ranks"][self.rank].get("state", {})  # each rank's own (PerRank)
                load_in_place(obj, ranks[name] if name in per_rank else saved[name])
        except (RuntimeError, ValueError, KeyError) as e:  # another network, or a checkpoint of another version
            flag = f"--resume {a.resume}" if saved is not None else f"--load-model {a.load_model}"
            bare = f"; weights alone keep no flags: the --env-id and network's flags are this command's ({a.env_id})"
            why = str(e).splitlines()[-1].strip() + (bare if saved is None and "args" not in self.model else "")
            raise UsageError(f"{flag} does not fit this agent: {why}") from None
        if saved is not None:
            obs = self.restore(saved, obs, note)
        if self.world_size > 1:
            broadcast_from_rank_0(alike(objects, per_rank))
            load_ranks_own(objects, saved["ranks"][self.rank].get("apart", {}) if saved else {})
        if a.eval_only:  # no training: a folder of its own, the model's left as it is
            seed = f"seed {a.seed}" if "args" in self.model else f"weights alone: --env-id {a.env_id}, --seed {a.seed}"
            note(f"--eval-only: evaluating {a.load_model} ({seed}) into a new run folder, {self.dir}")
        elif total_steps < 0.999 * a.total_timesteps:  # not for 5M -> 4,999,168
            note(f"--total-timesteps {a.total_timesteps:,} is rounded down to whole rollouts: {total_steps:,}")
        failed = None
        try:  # rank 0's outputs; its failure (no W&B login, a folder it cannot write) stops every rank
            self.outputs = opened_outputs(self, saved, total_steps) if self.rank == 0 else None
        except (UsageError, OSError) as e:
            failed = e
        if failed := rank_0s(failed):
            raise failed
        return obs

    def restore(self, saved: dict, obs, note):
        """--resume: the counters, last returns, this rank's RNGs and envs from `saved`; the envs' observation."""
        c = saved["counters"]  # a run that has ended would only evaluate again; one of K seeds trains on (seeds_flags)
        reached = c["target_reached"] and saved["args"]["target_return"] == self.args.target_return
        if (reached or c["global_step"] >= self.total_steps) and self.progress.k == 1:
            more = "pass --target-return None, or a higher one" if reached else "raise --total-timesteps"
            raise UsageError(f"--resume {self.args.resume}: the run has ended; to train on, {more}")
        self.progress.restore(self.index, c | {"target_reached": reached}, saved["recent_returns"])  # (another: on)
        self.checkpointed, mine = saved["counters"]["iteration"], saved["ranks"][self.rank]
        torch.set_rng_state(mine["rng"])
        device = next(self.objects["agent"].parameters()).device
        if mine["cuda_rng"] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda_rng"], device)
        obs = obs if mine["envs"] is None else self.objects["envs"].load_state_dict(mine["envs"])
        anew = "; the envs have no state_dict(), so their episodes start anew" if mine["envs"] is None else ""
        note(f"resumed {self.dir} at step {self.progress.global_step:,}{anew}")
        return obs

    def save(self, note) -> None:
        """checkpoint.pt, atomically: the objects, each torchrun rank's RNGs, envs and own state, the counters."""
        with self.own():
            envs, device = self.objects["envs"], next(self.objects["agent"].parameters()).device
            cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
            on_cpu = lambda x: x.cpu() if torch.is_tensor(x) else x  # gathered under NCCL: rebuilt on cuda:r
            own = {k: pytree.tree_map(on_cpu, state(v)) for k, v in kept(self.objects).items() if k in self.per_rank}
            envs = envs.state_dict() if hasattr(envs, "state_dict") else None  # EnvPool's emulators: none
            ranks = [mine := {"rng": torch.get_rng_state(), "cuda_rng": cuda, "envs": envs, "state": own}]
            if self.world_size > 1:  # every rank's RNGs, envs and own state, to rank 0
                mine["apart"] = ranks_apart(alike(self.objects, self.per_rank), self.noted_apart, note)
                dist.gather_object(mine, ranks := [None] * self.world_size if self.rank == 0 else None, dst=0)
            self.checkpointed = self.progress.iteration
            if self.rank == 0:
                saved = {k: state(v) for k, v in kept(self.objects).items() if k not in own}
                p, i, wandb = self.progress, self.index, self.outputs.wandb
                saved |= dict(ranks=ranks, script=self.script, args=asdict(self.args), counters=p.counters(i))
                saved |= dict(recent_returns=p.recent(i), wandb_id=wandb and wandb.id)
                # copies: a view would save its whole storage (K seeds' stacked tensors: each file K times too big)
                saved = pytree.tree_map(lambda x: x.clone() if torch.is_tensor(x) else x, saved)
                write_atomically(os.path.join(self.dir, "checkpoint.pt"), saved)

    def play(self, evaluate, video):
        with self.own():
            return greedy(evaluate, self.objects["agent"], self.objects["envs"], self.args, video)

    def film(self, record_video, rollout) -> None:
        path = os.path.join(self.dir, "videos", f"training_iter{self.progress.iteration:05d}.mp4")
        if greedy(record_video, self.objects["agent"], self.objects["envs"], rollout, self.args, path):
            self.outputs.video(path, "videos/training")

    def finish(self, status: str, whole: bool, stopped: int, setup: dict, evaluate, note) -> int:
        """The final checkpoint (when the state is `whole`), then on rank 0 the model, the final evaluation (not after
        a signal), summary.json and the result line (none after a refusal); the signal that stopped it (0: none)."""
        if whole and not self.args.eval_only and self.checkpointed != self.progress.iteration:
            self.save(note)
        if whole and self.world_size > 1:  # the last collective: rank 0 alone goes on, however long it evaluates
            dist.barrier()
        if self.outputs is None:  # not rank 0, or not opened (a flag refused late, a failed resume leave no trace)
            return stopped
        s = summary(self, status, setup)
        if status != "non-finite loss" and self.args.save_model:  # NaN weights are not worth keeping
            s["model_path"] = os.path.join(self.dir, f"{self.args.exp_name}.cleanrl_model")
            with self.own():
                torch.save(self.objects["agent"].state_dict(), s["model_path"])
        try:
            if self.args.eval_episodes and status in ("completed", "target return reached", "evaluated"):
                stopped = stopped or self.final_evaluation(s, evaluate, note)
            if stopped and self.args.eval_only:  # its evaluation is the run
                s["status"] = status = "interrupted"
        except Exception:  # an error in the evaluation (a copy's, a video's): the run's outputs, then its traceback
            s["status"] = status = "error"
            raise
        finally:
            write_atomically(os.path.join(self.dir, "summary.json"), s | {"args": asdict(self.args)})
            self.outputs.close(s["eval_mean_return"], self.progress.global_step)
            if status != "refused" and self.says_result:  # (an error: its traceback follows)
                label = "stopped by the error below" if status == "error" else status
                print(f"{label}: {result_line(s)}; outputs in {self.dir}")  # last, after W&B's own summary
        return stopped  # (a signal that ends one seed's final evaluation ends the next seeds' too)

    def final_evaluation(self, summary: dict, evaluate, note) -> int:
        """The confirming evaluation (unless filmed) or a new one, into `summary`; the signal that cut it (0: none)."""
        video = os.path.join(self.dir, "videos", "evaluation.mp4") if self.args.capture_video else None
        for sig in (signal.SIGINT, signal.SIGTERM):  # at once: an evaluation has no iterations to finish
            signal.signal(sig, interrupt)
        try:
            if not (reuse := self.eval_returns is not None and self.progress.target_reached[self.index] and not video):
                note(f"evaluating the policy on {self.args.eval_episodes} episode{'s' * (self.args.eval_episodes > 1)}")
            returns = self.eval_returns if reuse else self.play(evaluate, video)
            summary["eval_returns"], summary["eval_mean_return"] = returns, float(np.mean(returns))
            if video:
                self.outputs.video(video, "videos/evaluation")
        except KeyboardInterrupt as e:
            return e.args[0] if e.args else signal.SIGINT
        return 0


def opened_outputs(seed: Seed, saved: dict | None, total_steps: int) -> Outputs:
    """Rank 0's outputs of `seed`'s folder, made after W&B's login (a refused --track leaves none)."""
    done, resumed = seed.progress.global_step, saved is not None
    outputs = Outputs(seed.dir, seed.args, saved and saved["wandb_id"], total_steps, done, resumed)
    os.makedirs(seed.dir, exist_ok=True)
    try:  # a resumed folder that cannot be written: one error now, not TensorBoard's threads' tracebacks
        tempfile.TemporaryFile(dir=seed.dir).close()
    except OSError as e:  # naming the folder, not the probe's file in it
        raise OSError(e.errno, e.strerror, seed.dir) from None
    return outputs


def greedy(play, agent, *args):
    """play(agent, *args), an evaluation or a video, in eval mode (dropout off)."""
    agent.eval()
    try:
        return play(agent, *args)
    finally:
        agent.train()


def summary(seed: Seed, status: str, setup: dict) -> dict:
    """summary.json of `seed`'s run, before its evaluation and model (solved: the env's "solved" level reached)."""
    a, p, i = seed.args, seed.progress, seed.index
    c, mean = p.counters(i), p.mean(full=False)[i]
    s = dict(env_id=a.env_id, exp_name=a.exp_name, seed=a.seed, device=a.device, world_size=seed.world_size)
    s |= dict(status=status, total_env_steps=p.global_step, iterations=p.iteration, wall_seconds=round(p.seconds, 3))
    sps = round(p.timed_steps / p.seconds, 1) if p.seconds else None
    parts = {part: round(seconds, 3) for part, seconds in setup.items()}  # built; compiled, recorded if they were
    s |= dict(setup_seconds=round(sum(setup.values()), 3), setup_parts=parts, mean_sps=sps)
    s |= dict(episodes=c["episodes"], mean_return_last_100=None if math.isnan(mean) else float(mean))
    s |= dict(solved_threshold=getattr(seed.objects["envs"], "reward_threshold", None), solved_at_step=c["solved_step"])
    s |= dict(solved_at_seconds=c["solved_seconds"] and round(c["solved_seconds"], 3))
    return s | dict(eval_returns=None, eval_mean_return=None, model_path=None)


def result_line(summary: dict) -> str:
    shown = "total_env_steps wall_seconds mean_sps mean_return_last_100 solved_at_step eval_mean_return".split()
    number = lambda value: f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"
    text = ", ".join(f"{key} {number(summary[key])}" for key in shown if summary[key] is not None)
    train_mean, eval_mean = summary["mean_return_last_100"], summary["eval_mean_return"]
    if train_mean is not None and eval_mean is not None and abs(eval_mean - train_mean) > 0.1 * abs(train_mean):
        text += " (training's mean spans earlier policies, sampled; the evaluation plays the final one)"
    return text


def new_folder(name: str, started: int) -> str:
    """runs/`name`__`started`, a run folder no other run has (a second run in the same second: __{time}_2)."""
    folder, i = os.path.join("runs", f"{name}__{started}"), 1
    while os.path.exists(folder if i == 1 else f"{folder}_{i}"):
        i += 1
    return folder if i == 1 else f"{folder}_{i}"


def kept(objects: dict) -> dict:
    """The objects a checkpoint keeps by name: all but the envs (kept per torchrun rank)."""
    return {k: v for k, v in objects.items() if k != "envs"}
