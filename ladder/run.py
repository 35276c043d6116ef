"""`Run`: a training run's folder and everything written to it, its clock, counters, signals and final evaluation."""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from ladder.checkpoint import load_in_place, read_checkpoint, restore_progress, save_checkpoint
from ladder.cli import UsageError, script_file
from ladder.distributed import broadcast_from_rank_0, load_ranks_own


class Run(contextlib.AbstractContextManager):
    """The run folder runs/{env_id}__{exp_name}__{seed}__{time} and all in it (TensorBoard, W&B with --track, videos,
    checkpoints, model, summary.json), the progress bar, --resume, signals, the NaN stop and the final evaluation.

    `evaluate(agent, envs, args, video)` and `record_video(agent, envs, rollout, args, path)` are the script's: the
    final evaluation (its returns, filmed at `video` unless None) and a video during training (the path, or None)."""

    resumable = None  # the folder of the last run stopped with a checkpoint, for main's last line
    progress_line_seconds = 30.0  # without a terminal (nohup, CI): a plain progress line this often, for the bar

    def __init__(self, args, evaluate, record_video):
        from ladder.seeds import Built, Seeds

        self.args, self.evaluate, self.record_video, self.script = args, evaluate, record_video, script_file(type(args))
        self.saved = read_checkpoint(args.resume, self.script) if args.resume else None
        self.model = read_checkpoint(args.load_model, self.script, "--load-model") if args.load_model else None
        resumed = args.resume and (args.resume if os.path.isdir(args.resume) else os.path.dirname(args.resume) or ".")
        self.dir = resumed or os.path.join("runs", f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        building = Seeds.current is not None and Seeds.current.building is not None  # one of --num-seeds K's seeds
        self.seeds = Seeds.current if not building else None  # --num-seeds K: the lead, which drives the seeds' runs
        self.built, self.quiet = Built if building else None, building and Seeds.current.building > 0
        # the run's progress, checkpointed as is; "seconds" and "timed_steps" leave out set-up and compilation
        self.counters = dict(iteration=0, global_step=0, episodes=0, seconds=0.0, timed_steps=0, target_reached=False)
        self.counters |= dict(solved_step=None, solved_seconds=None)  # the first step where the mean reached the env's
        self.recent_returns: deque[float] = deque(maxlen=100)
        self.agent = self.progress = self.writer = self.wandb = self.eval_returns = self.last_line = None
        self.handlers, self.stop_signal, self.checkpointed, self.next_check, self.diverged = {}, 0, -1, 0, set()
        self.looping, self.stopping, self.first_iteration = False, 0, 1  # in `iterations`; the ranks' stop signal
        self.setup_seconds, self.clock = 0.0, time.perf_counter()  # the one clock: set-up until `start`

    def start(self, agent: nn.Module, envs, optimizer: torch.optim.Optimizer, total_steps: int, obs=None, **stateful):
        """Training begins: the clock starts, the outputs open; --resume restores the checkpoint (`stateful`: your
        state, tensors or objects with a state_dict), --load-model the agent's weights. Returns `obs` or the envs'."""
        self.agent, self.envs, self.optimizer, self.device = agent, envs, optimizer, next(agent.parameters()).device
        a, self.total_steps = self.args, total_steps
        self.per_rank = {k for k, v in stateful.items() if isinstance(v, PerRank)}  # each torchrun rank's own
        yours = {k: v.value if isinstance(v, PerRank) else v for k, v in stateful.items() if v is not None}
        self.stateful = {"agent": agent, "optimizer": optimizer} | yours
        if odd := [k for k, v in self.stateful.items() if not (torch.is_tensor(v) or hasattr(v, "state_dict"))]:
            raise UsageError(f"run.start({odd[0]}=...) must be a tensor or have a state_dict(), for --resume")
        scheduled = any("initial_lr" in group for group in optimizer.param_groups)  # what an lr_scheduler sets
        if scheduled and not any(getattr(obj, "optimizer", None) is optimizer for obj in self.stateful.values()):
            raise UsageError(
                "a torch.optim.lr_scheduler drives the optimizer: give it to run.start(..., "
                "scheduler=scheduler), or a --resume would start its schedule over"
            )
        if scheduled and getattr(a, "anneal_lr", False):  # train()'s annealing would set the rate over the scheduler's
            raise UsageError("a torch.optim.lr_scheduler and --anneal-lr both set the rate: pass --no-anneal-lr")
        obs = self.seeds.start(self) if self.seeds is not None else self.open(obs)
        if self.built is not None:  # one of --num-seeds K seeds, built: its train() ends here (ladder/seeds.py)
            raise self.built(self, obs)
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            self.handlers = {s: signal.signal(s, self.request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        self.first_iteration, self.saved = self.counters["iteration"] + 1, None  # the restored tensors are in place
        if a.compile and self.total_steps > self.counters["global_step"]:  # said once its handlers are in place
            self.note("--compile: the first iteration compiles its phases (seconds to minutes; Ctrl-C stops it)")
        self.setup_seconds, self.clock = time.perf_counter() - self.clock, time.perf_counter()
        return obs

    def open(self, obs):
        """--load-model's weights and --resume's checkpoint in place; the outputs open. Returns `obs` or the envs'."""
        a, agent, optimizer, total_steps = self.args, self.agent, self.optimizer, self.total_steps
        # the optimizer's settings (torch's load_state_dict takes the checkpoint's), but the rate: the flag's, annealed
        for saved, group in zip(self.saved["optimizer"]["param_groups"] if self.saved else [], optimizer.param_groups):
            for key in [key for key, value in saved.items() if key not in ("params", "lr") and group.get(key) != value]:
                self.note(f"the checkpoint's optimizer {key} {saved[key]} replaces the code's {group.get(key)}")
        try:  # --load-model: a checkpoint's agent or a saved model; --resume: all that `save_checkpoint` wrote
            if self.model is not None:
                agent.load_state_dict(self.model.get("agent", self.model))
            for name, obj in self.stateful.items() if self.saved is not None else ():
                ranks = self.saved["ranks"][self.rank].get("state", {})  # (a checkpoint before PerRank: none)
                load_in_place(obj, ranks[name] if name in self.per_rank else self.saved[name])
        except (RuntimeError, ValueError) as e:  # another network, or a checkpoint of another version of the script
            flag = f"--resume {a.resume}" if self.saved is not None else f"--load-model {a.load_model}"
            raise UsageError(f"{flag} does not fit this agent: {str(e).splitlines()[-1].strip()}") from None
        if self.saved is not None:  # --resume: the rest of the checkpoint, back in place
            obs = restore_progress(self, self.saved, obs)
        if self.world_size > 1:
            broadcast_from_rank_0(self)
            load_ranks_own(self, self.saved["ranks"][self.rank].get("apart", {}) if self.saved else {})
        if self.rank == 0:
            self.open_outputs(total_steps)
        if a.eval_only:  # no training: a folder of its own, the model's left as it is
            self.note(f"--eval-only: evaluating {a.load_model} into a new run folder, {self.dir}")
        elif total_steps < 0.999 * a.total_timesteps:  # not for 5M -> 4,999,168
            self.note(f"--total-timesteps {a.total_timesteps:,} is rounded down to whole rollouts: {total_steps:,}")
        return obs

    def open_outputs(self, total_steps: int) -> None:
        """Rank 0's outputs: a W&B run (--track), the TensorBoard writer, the progress bar on a terminal."""
        a = self.args
        if a.track:  # a W&B run of its own (--num-seeds: K runs in one process), given the scalars by `log`
            wandb = importlib.import_module("wandb")
            settings = dict(project=a.wandb_project_name, entity=a.wandb_entity, group=a.wandb_group, config=asdict(a))
            this_run = dict(name=os.path.basename(self.dir), id=self.saved and self.saved["wandb_id"], resume="allow")
            self.wandb = wandb.init(reinit="create_new", **settings, **this_run)
            self.wandb.define_metric("*", step_metric="global_step")  # TensorBoard's x-axis
        # with --resume, events logged after the checkpoint (by a run killed later) are hidden: no step twice
        self.writer = SummaryWriter(self.dir, purge_step=self.counters["global_step"] + 1 if self.saved else None)
        table = "".join(f"\n|{key}|{value}|" for key, value in asdict(a).items())
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|" + table)
        if a.progress_bar and not a.eval_only and sys.stderr.isatty():  # a log file would fill with its redraws
            end = None if a.target_return is None else f"until return {a.target_return:g}"  # or the ETA's end
            self.progress = tqdm(total=total_steps, initial=self.counters["global_step"], unit_scale=True, desc=end)
        elif a.progress_bar and not a.eval_only:  # no terminal: `log` writes a plain line now and then
            self.last_line = time.perf_counter()

    def request_stop(self, signum: int, frame) -> None:
        """SIGINT/SIGTERM: stop at the end of this iteration, with a checkpoint; a second Ctrl-C stops at once, and so
        does a first one while --compile compiles (minutes on a CPU), before any iteration is done to keep."""
        if self.args.compile and self.counters["iteration"] < self.first_iteration:
            self.note(f"{signal.Signals(signum).name} while compiling: stopping now, before the first iteration ends")
            raise KeyboardInterrupt(signum, "while compiling")  # (signum) alone: stopped after an iteration
        self.stop_signal = self.stop_signal or signum
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C raises KeyboardInterrupt at once
        self.note(f"{signal.Signals(signum).name}: stopping after this iteration (Ctrl-C again: at once)")

    def greedy(self, play, *args):  # play(agent, *args), an evaluation or a video, in eval mode (dropout off)
        self.agent.eval()
        try:
            return play(self.agent, *args)
        finally:
            self.agent.train()

    def holding(self, state: tuple) -> tuple:
        """`state` and the objects given to `start` by name (a module, an object with a state_dict; not a tensor): what
        an iteration may change, which the stacked seeds and a CUDA graph then hold as they hold the agent."""
        given = [v for k, v in self.stateful.items() if k not in ("agent", "optimizer") and not torch.is_tensor(v)]
        return (*state, *[v for v in given if not any(v is s for s in state)])

    def each(self, fn, *args):
        """`fn(*args)`: what draws from a seed's own generators (its noise) or is a seed's own (its rollout buffer);
        with --num-seeds K, called for each seed on its objects, the results stacked [K, ...] (ladder/seeds.py)."""
        return fn(*args) if self.seeds is None else self.seeds.each(fn, *args)

    def note(self, message: str) -> None:
        """One line to stderr that does not break the progress bar (rank 0's only, under torchrun)."""
        tqdm.write(f"note: {message}", file=sys.stderr) if self.rank == 0 and not self.quiet else None

    def log(self, env_steps: int, stats: dict[str, torch.Tensor], episodes, rollout=None) -> bool:
        """One iteration's logs and videos from one host read (shared by the torchrun ranks: they decide alike).
        `episodes`: (ended, return, length), tensors of one shape, the episodes that ended in the iteration; `rollout`,
        what `record_video` films. FloatingPointError on a NaN loss; True once at the target. The checkpoint and a
        signal's stop come at the end of the iteration (`iterations`)."""
        k = 1 if self.seeds is None else len(self.seeds.runs)  # --num-seeds K: a row per seed, stacked
        for tag, value in stats.items():  # a number each (a seed's own sum of a stacked x: x.flatten(1).sum(1))
            if value.numel() != k:
                each = "a number" if k == 1 else f"one number per seed under --num-seeds {k}"
                raise UsageError(f"stats[{tag!r}] has shape {tuple(value.shape)}; run.log takes {each}")
        episodes = torch.cat([x.reshape(k, -1).float() for x in episodes], 1)  # (ended, return, length)
        head = torch.tensor([env_steps, self.stop_signal], dtype=torch.float32, device=self.device).expand(k, 2)
        values = torch.stack(list(stats.values()), -1).reshape(k, -1).float()
        numbers = torch.cat((head, values, episodes), 1).cpu().numpy()  # the iteration's one host read
        if self.seeds is not None:  # each seed's logs from its row (ladder/seeds.py)
            reached = self.seeds.log(self, numbers, list(stats), rollout)
        else:
            ranks = [numbers[0]]  # under torchrun every rank's numbers to every rank
            if self.world_size > 1:
                dist.all_gather_object(ranks := [None] * self.world_size, numbers[0])
            reached = self.record(ranks, list(stats), lambda: rollout)
        if not self.looping:  # log called from a loop of the code's own: the end of the iteration is now
            self.end_of_iteration()
        return reached

    def record(self, ranks: list, tags: list, film) -> bool:
        """`log` from the host's numbers (each rank's: steps, stop signal, `tags`' values, episodes): TensorBoard, W&B,
        the progress bar, the target; `film()` gives the rollout to film. True once at the target."""
        c, k = self.counters, 2 + len(tags)
        c["iteration"] += 1
        steps, stop_signal = int(sum(r[0] for r in ranks)), int(max(r[1] for r in ranks))
        values = dict(zip(tags, np.mean([r[2:k] for r in ranks], axis=0).tolist()))  # the ranks' mean losses
        ended, returns, lengths = np.concatenate([r[k:].reshape(3, -1) for r in ranks], axis=1)
        returns, lengths = returns[ended > 0], lengths[ended > 0]
        c["global_step"] += steps
        # every loss must be finite (explained variance is NaN for constant returns); another statistic NaN: no value
        if not all(math.isfinite(v) for t, v in values.items() if t.startswith("losses/") and "explained" not in t):
            raise FloatingPointError(f"non-finite loss at iteration {c['iteration']} (env step {c['global_step']})")
        now = time.perf_counter()
        if self.args.compile and c["iteration"] == self.first_iteration:  # LeanRL's burn-in
            self.note(f"--compile: iteration {c['iteration']} took {now - self.clock:.1f} s (compilation), not counted")
            self.setup_seconds += now - self.clock
        else:
            c["seconds"], c["timed_steps"] = c["seconds"] + now - self.clock, c["timed_steps"] + steps
        self.clock = now
        self.recent_returns.extend(returns.tolist())
        c["episodes"] += len(returns)
        mean = float(np.mean(self.recent_returns)) if len(self.recent_returns) == 100 else -math.inf  # a full window
        threshold, target = getattr(self.envs, "reward_threshold", None), self.args.target_return
        if threshold is not None and c["solved_step"] is None and mean >= threshold:
            c["solved_step"], c["solved_seconds"] = c["global_step"], c["seconds"]
        reached = target is not None and mean >= target and self.confirmed(mean, target)  # a seed of K trains on
        c["target_reached"] = c["target_reached"] or reached
        sps = int(c["timed_steps"] / c["seconds"]) if c["seconds"] else None
        scalars = {"charts/learning_rate": self.optimizer.param_groups[0]["lr"], "charts/SPS": sps} | values
        if len(returns):
            scalars |= {"charts/episodic_return": returns.mean(), "charts/episodic_length": lengths.mean()}
        scalars = {tag: float(value) for tag, value in scalars.items() if value is not None and not math.isnan(value)}
        if self.rank == 0:  # the iteration's scalars as one event, not an add_scalar each (~0.1 ms each, K seeds')
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()])
            self.writer.file_writer.add_summary(summary, c["global_step"])
        if self.wandb is not None:  # not W&B's sync_tensorboard: it follows one run per process
            self.wandb.log(scalars | {"global_step": c["global_step"]})
        recent = f"{np.mean(self.recent_returns or [np.nan]):.1f}"
        if self.progress is not None:
            self.progress.update(steps)
            self.progress.set_postfix(SPS=sps, ret=recent, refresh=False)
        elif self.last_line is not None and now - self.last_line >= self.progress_line_seconds:
            self.last_line, done, total = now, c["global_step"], self.total_steps
            speed = f"{sps:,} SPS, {tqdm.format_interval((total - done) / sps)} left" if sps else "compiling"
            seed = "" if self.built is None else f"seed {self.args.seed}: "
            recent += f" (last {len(self.recent_returns)})"
            print(f"{seed}{done:,}/{total:,} steps, {speed}, return {recent}", file=sys.stderr)
        interval = self.args.video_interval if self.args.capture_video and self.rank == 0 else 0
        if interval and (c["iteration"] - 1) % interval == 0:  # iterations 1, 1 + interval, ...
            path = os.path.join(self.dir, "videos", f"training_iter{c['iteration']:05d}.mp4")
            if self.greedy(self.record_video, self.envs, film(), self.args, path) and self.wandb is not None:
                self.wandb.log({"videos/training": sys.modules["wandb"].Video(path, format="mp4")})
        self.stopping = stop_signal  # the ranks stop together
        return c["target_reached"]

    def iterations(self):
        """The iterations left, numbered on from the checkpoint's, until the run's steps are done: `for iteration in
        run.iterations():` in train(), `run.log` once in each. Between two, after the whole loop body (what follows
        `run.log`, a scheduler's step, is in the checkpoint), the checkpoint is written when due, and a signal
        stops the run."""
        self.looping = True
        try:
            while self.counters["global_step"] < self.total_steps:
                logged = self.counters["iteration"]
                yield logged + 1
                if self.counters["iteration"] == logged:
                    raise UsageError("train() must call run.log(...) once in each iteration of run.iterations()")
                self.end_of_iteration()
        finally:
            self.looping = False

    def end_of_iteration(self) -> None:
        """The checkpoint every `checkpoint-interval` iterations, then KeyboardInterrupt(signal) if a signal came."""
        if self.args.checkpoint_interval and self.counters["iteration"] % self.args.checkpoint_interval == 0:
            self.seeds.checkpoint() if self.seeds is not None else save_checkpoint(self)
        if self.stopping:
            raise KeyboardInterrupt(self.stopping)

    def confirmed(self, mean: float, target: float) -> bool:
        """Whether the policy `evaluate` plays reaches the target too (a sampling policy can, while its greedy twin
        drifts off); asked again after 100 more episodes, rank 0 evaluating for all; its time is not training time."""
        if not self.args.eval_episodes or self.counters["episodes"] < self.next_check:
            return not self.args.eval_episodes  # without an evaluation the training episodes decide
        start, self.next_check = time.perf_counter(), self.counters["episodes"] + 100
        self.note(f"the last 100 episodes' mean return {mean:.1f} reached the target: evaluating the policy to confirm")
        self.eval_returns = self.greedy(self.evaluate, self.envs, self.args, None) if self.rank == 0 else [-math.inf]
        ok = torch.tensor(float(np.mean(self.eval_returns) >= target), device=self.device)
        if self.world_size > 1:  # the ranks stop together
            dist.broadcast(ok, src=0)
        if not ok:
            self.note(f"the evaluation's mean return is {np.mean(self.eval_returns):.1f}: training on")
        self.clock += time.perf_counter() - start
        return bool(ok)

    def __exit__(self, exc_type, exc, tb) -> None:  # None: an exception goes on to main
        if self.built is not None and isinstance(exc, self.built):  # a seed built: the lead finishes it, at its end
            return
        try:  # the handlers stay while the outputs are written: a signal now ends only the final evaluation
            self.seeds.finish(exc_type, exc) if self.seeds is not None else self.finish(exc_type, exc)
        finally:
            for sig, handler in self.handlers.items():
                signal.signal(sig, handler)

    def finish(self, exc_type, exc) -> None:  # the final checkpoint; then rank 0's model, evaluation and summary
        if self.progress is not None:
            self.progress.total = self.progress.n  # the bar ends where training ended
            self.progress.close()
        a, c, stopped = self.args, self.counters, isinstance(exc, KeyboardInterrupt) and len(exc.args) == 1
        status = "evaluated" if a.eval_only else "target return reached" if c["target_reached"] else "completed"
        if exc is not None:
            status = {KeyboardInterrupt: "interrupted", FloatingPointError: "non-finite loss"}.get(exc_type, "error")
        whole = (exc is None or stopped) and self.agent is not None  # at the end of an iteration: not a second Ctrl-C
        if whole and not a.eval_only and self.checkpointed != c["iteration"]:  # the state is whole: a checkpoint
            save_checkpoint(self)
        if whole and self.world_size > 1:  # the last collective: rank 0 alone goes on, however long it evaluates
            dist.barrier()
        if self.writer is None:  # not rank 0, or not started (a flag refused late, a failed resume leave no trace)
            return
        # summary.json: the run, its progress, its returns (solved: the env's "solved" level reached), the evaluation
        s = dict(env_id=a.env_id, exp_name=a.exp_name, seed=a.seed, device=a.device, world_size=self.world_size)
        s |= dict(status=status, total_env_steps=c["global_step"], iterations=c["iteration"])
        seconds, sps = round(c["seconds"], 3), round(c["timed_steps"] / c["seconds"], 1) if c["seconds"] else None
        s |= dict(
            wall_seconds=seconds, setup_seconds=round(self.setup_seconds, 3), mean_sps=sps, episodes=c["episodes"]
        )
        s["mean_return_last_100"] = float(np.mean(self.recent_returns)) if self.recent_returns else None
        s |= dict(solved_threshold=getattr(self.envs, "reward_threshold", None), solved_at_step=c["solved_step"])
        s |= dict(solved_at_seconds=c["solved_seconds"] and round(c["solved_seconds"], 3))
        s |= dict(eval_returns=None, eval_mean_return=None, model_path=None)
        if status != "non-finite loss" and a.save_model:  # NaN weights are not worth keeping
            s["model_path"] = os.path.join(self.dir, f"{a.exp_name}.cleanrl_model")
            torch.save(self.agent.state_dict(), s["model_path"])
        if a.eval_episodes and status in ("completed", "target return reached", "evaluated") and not self.stop_signal:
            self.final_evaluation(s)
        with open(os.path.join(self.dir, "summary.json"), "w") as f:
            json.dump(s | {"args": asdict(a)}, f, indent=2)
        self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        shown = "total_env_steps wall_seconds mean_sps mean_return_last_100 solved_at_step eval_mean_return".split()
        number = lambda value: f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"
        line = ", ".join(f"{key} {number(s[key])}" for key in shown if s[key] is not None)
        train_mean, eval_mean = s["mean_return_last_100"], s["eval_mean_return"]
        if train_mean is not None and eval_mean is not None and abs(eval_mean - train_mean) > 0.1 * abs(train_mean):
            line += " (training samples its actions, the evaluation plays the greedy policy)"
        if status == "interrupted" and self.checkpointed >= 0:  # main's last line: the command that goes on
            Run.resumable = self.dir
        if not isinstance(exc, UsageError):  # a refusal is main's one `error:` line, not a result line
            print(f"{status}: {line}; outputs in {self.dir}")  # last, after W&B's own summary

    def final_evaluation(self, summary: dict) -> None:
        """The evaluation that confirmed the target (unless filmed), or `eval-episodes` played now, into `summary`,
        TensorBoard and W&B. A signal now ends it at once; summary.json is still written."""
        a, c = self.args, self.counters
        video = os.path.join(self.dir, "videos", "evaluation.mp4") if a.capture_video else None
        for sig in self.handlers:
            signal.signal(sig, signal.default_int_handler)
        with contextlib.suppress(KeyboardInterrupt):
            if not (reuse := c["target_reached"] and video is None):
                self.note(f"evaluating the policy on {a.eval_episodes} episodes")
            summary["eval_returns"] = self.eval_returns if reuse else self.greedy(self.evaluate, self.envs, a, video)
            summary["eval_mean_return"] = float(np.mean(summary["eval_returns"]))
            self.writer.add_scalar("eval/episodic_return", summary["eval_mean_return"], c["global_step"])
            if self.wandb is not None:  # at the last global_step (define_metric's step_sync)
                self.wandb.log({"eval/episodic_return": summary["eval_mean_return"]})
                if video and os.path.exists(video):
                    self.wandb.log({"videos/evaluation": sys.modules["wandb"].Video(video, format="mp4")})


class PerRank:
    """State given to `run.start` that each torchrun rank keeps its own of, as its envs (a recurrent policy's hidden
    state): `run.start(..., hidden=PerRank(hidden))`. Saved and restored per rank; not broadcast from rank 0."""

    def __init__(self, value):
        self.value = value
