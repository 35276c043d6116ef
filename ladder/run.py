"""`Run`: what `train()` calls (its seeds, start, iterations, logs, videos, checkpoints and end)."""

import contextlib
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from tqdm import tqdm

from ladder.compile import compile_error, compile_settings
from ladder.cuda_graph import CudaGraph
from ladder.flags import UsageError
from ladder.seeds import Seeds
from ladder.signals import Signals


class Run(contextlib.AbstractContextManager):
    """A run (runs/{env_id}__{exp_name}__{seed}__{time}; K seeds: K and an aggregate), start to end. The script's
    `evaluate(agent, envs, args, video)` returns episodes' returns; `record_video(agent, envs, rollout, args, path)`."""

    def __init__(self, args, evaluate, record_video):
        self.args, self.evaluate, self.record_video = args, evaluate, record_video
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.all = Seeds(args, self.rank, self.world_size)  # the run's seeds: one, or K (--sweep: K per configuration)
        self.k = self.all.k
        self.progress, self.runs, self.dir, self.stopping = self.all.progress, self.all.runs, None, 0
        self.first_iteration, self.clock, self.setup = 1, time.perf_counter(), {}  # setup: summary.json's setup_parts
        self.signals = Signals(self.note, lambda: args.compile and self.progress.iteration < self.first_iteration)
        self.args_per_run = self.all.flags  # `for args in run.args_per_run:` builds each run's objects

    def start(self, agent: nn.Module, envs, optimizer: torch.optim.Optimizer, total_steps: int, obs=None, **stateful):
        """A seed's objects (`stateful`: yours by name, tensors or objects with a state_dict), restored by --resume or
        --load-model; the last seed's stacks the K seeds and starts the clock. Returns `obs` or the envs' (stacked)."""
        objects = {"agent": agent, "envs": envs, "optimizer": optimizer}
        objects |= {k: v.value if isinstance(v, PerRank) else v for k, v in stateful.items() if v is not None}
        check_objects(objects, self.args, self.k)
        per_rank = {k for k, v in stateful.items() if isinstance(v, PerRank)}  # each torchrun rank's own
        obs = self.all.add(objects, per_rank, obs, total_steps, self.note)
        if len(self.runs) < self.k:
            return obs
        self.agent, self.envs, self.optimizer, self.stateful, self.dir = agent, envs, optimizer, objects, self.all.dir
        self.device, self.total_steps, self.stack = next(agent.parameters()).device, total_steps, self.all.stack
        self.threshold = getattr(envs, "reward_threshold", None)  # the envs' "solved" level
        self.signals.install()
        self.first_iteration = self.progress.iteration + 1
        if self.args.compile and total_steps > self.progress.global_step:  # said once its handlers are in place
            self.note("--compile: the first iteration compiles its phases (seconds to minutes; Ctrl-C stops it)")
            compile_settings()
        self.setup["built"], self.clock = time.perf_counter() - self.clock, time.perf_counter()
        return obs

    def each(self, fn, *args):
        """`fn(*args)`, a seed's own (its noise, its rollout buffer); --num-seeds K: vmapped over the K, stacked."""
        return fn(*args) if self.k == 1 else self.stack.call(fn, *args)

    def one_by_one(self, fn, *args):
        """`fn(*args)`; --num-seeds K: for each seed on its own objects in turn (Brax's JAX envs), stacked."""
        return fn(*args) if self.k == 1 else self.stack.one_by_one(fn, *args)

    def one_call(self, fn):
        """`fn`, device work, as one call: for K runs vmapped over their state (--compile: one graph); on a GPU recorded
        once as a CUDA graph and replayed (--cuda-graph); for one run off a GPU, `fn` itself."""
        call = fn
        if self.k > 1:
            call = lambda *args: self.stack.call(fn, *args, compile=self.args.compile)
            call.__name__ = f"{fn.__name__} of {self.k} seeds"
        return CudaGraph(call, self)

    def note(self, message: str) -> None:
        """One line to stderr that does not break the progress bar (rank 0's only, under torchrun)."""
        if self.rank == 0:
            tqdm.write(f"note: {message}", file=sys.stderr)

    def log(self, env_steps: int, stats: dict[str, torch.Tensor], episodes) -> None:
        """An iteration's logs, one host read for all seeds and ranks; FloatingPointError on a NaN loss."""
        values = one_number_each(stats, self.k, self.device)
        lr = torch.as_tensor(self.optimizer.param_groups[0]["lr"], dtype=torch.float32, device=self.device)
        head = torch.tensor([env_steps, self.signals.received], device=self.device).expand(self.k, 2)
        head = torch.cat((head, lr.reshape(-1, 1).expand(self.k, 1)), 1)  # each run's rate (a --sweep's differ)
        episodes = torch.cat([x.reshape(self.k, -1).float() for x in episodes], 1)  # (ended, return, length)
        numbers = torch.cat((head, values, episodes), 1).cpu().numpy()  # the one host read
        if self.world_size > 1:  # every rank's numbers to every rank, as one: steps summed, any's stop, mean losses
            dist.all_gather_object(ranks := [None] * self.world_size, numbers[0])
            head, n = [sum(r[0] for r in ranks), max(r[1] for r in ranks), ranks[0][2]], len(stats)
            episodes = np.concatenate([r[3 + n :].reshape(3, -1) for r in ranks], axis=1).reshape(-1)
            numbers = np.concatenate((head, np.mean([r[3 : 3 + n] for r in ranks], axis=0), episodes))[None]
        p, now = self.progress, time.perf_counter()
        compiling = self.args.compile and p.iteration + 1 == self.first_iteration  # LeanRL's burn-in: not training time
        tags, columns = p.record(numbers, list(stats), None if compiling else now - self.clock, self.threshold)
        if compiling:
            self.note(f"--compile: iteration {p.iteration} took {now - self.clock:.1f} s (compilation), not counted")
            self.setup["compiled"] = now - self.clock
        self.clock = now
        if self.rank == 0:
            self.all.report(tags, columns, int(numbers[0, 0]), self.total_steps)
            self.clock = time.perf_counter()  # TensorBoard's writes are not training time, nor are videos, evaluations
        self.stopping = int(numbers[:, 1].max())  # the ranks stop together

    def film(self, rollout=None) -> None:
        """--capture-video: every `video-interval` iterations, a video of the first seed's greedy policy."""
        a, p = self.args, self.progress
        if self.rank == 0 and a.capture_video and a.video_interval and (p.iteration - 1) % a.video_interval == 0:
            if self.k > 1:  # the first seed's rollout
                rollout = pytree.tree_map(lambda x: x[0] if torch.is_tensor(x) else x, rollout)
            self.runs[0].film(self.record_video, rollout)
            self.clock = time.perf_counter()

    def target_reached(self) -> bool:
        """Whether every seed's last 100 episodes reach `target-return`, each confirmed by an evaluation (greedy but
        in Atari: a sampling policy can while its greedy twin drifts off), asked again after 100 more episodes."""
        p, target, mean = self.progress, self.args.target_return, self.progress.mean()
        for i in np.nonzero((mean >= target) & ~p.target_reached)[0] if target is not None else ():
            seed, evaluated = self.runs[i], self.runs[i].args.eval_episodes > 0
            if not evaluated or p.episodes[i] < seed.next_check:  # without an evaluation the training episodes decide
                p.target_reached[i] = not evaluated
                continue
            seed.next_check = p.episodes[i] + 100
            reached = f"the last 100 episodes' mean return {mean[i]:.1f} reached the target"
            if self.k == 1:  # (K runs: a line each would bury the progress; one that trains on says which)
                self.note(f"{reached}: evaluating the policy to confirm")
            seed.eval_returns = seed.play(self.evaluate, None) if self.rank == 0 else [-math.inf]
            ok = torch.tensor(float(np.mean(seed.eval_returns) >= target), device=self.device)
            if self.world_size > 1:  # the ranks stop together
                dist.broadcast(ok, src=0)
            if not ok:
                who = f"{os.path.basename(seed.dir)}: " if self.k > 1 else ""
                self.note(f"{who}the evaluation's mean return is {np.mean(seed.eval_returns):.1f}: training on")
            p.target_reached[i], self.clock = bool(ok), time.perf_counter()  # the evaluation: not training time
        return bool(p.target_reached.all())

    def checkpoint(self) -> None:
        """checkpoint.pt in each seed's folder, every `checkpoint-interval` iterations (after a signal: at the end)."""
        if self.args.checkpoint_interval and self.progress.iteration % self.args.checkpoint_interval == 0:
            self.all.flush()  # the scalars before it on disk first: a resume after a kill logs on from it, no gap
            if self.stack:  # what each seed's checkpoint reads from its objects first made as the lead's (stacked.py)
                self.stack.share_lead()
            for seed in self.runs:
                seed.save(self.note)

    def iterations(self):
        """The iterations left (numbered on from a checkpoint's), `run.log` once in each; a signal stops after one."""
        if len(self.runs) < self.k:
            raise UsageError(
                f"{self.k} runs (--num-seeds, --sweep): build each one's objects in `for args in run.args_per_run:`"
            )
        while self.progress.global_step < self.total_steps:
            logged = self.progress.iteration
            yield logged + 1
            if self.progress.iteration == logged:
                raise UsageError("train() must call run.log(...) once in each iteration of run.iterations()")
            if self.stopping:
                raise KeyboardInterrupt(self.stopping)

    def __exit__(self, exc_type, exc, tb) -> None:  # None: an exception goes on to main
        """Each seed's end, then their aggregate (a signal ends just the evaluation); a compile error: one line."""
        if why := self.args.compile and compile_error(exc):
            exc_type, exc = UsageError, UsageError(why)
        try:
            stopped = self.all.finish(exc_type, exc, self.signals.received, self.setup, self.evaluate, self.note)
        finally:
            self.signals.restore()
        if why:
            raise exc from None
        if stopped and self.args.eval_only and exc is None:  # its evaluation was the run
            raise KeyboardInterrupt(stopped, "while evaluating")


def one_number_each(stats: dict, k: int, device: torch.device) -> torch.Tensor:
    """`stats` as a (k, len(stats)) tensor: one number per seed of each, a tensor (detached) or a Python number."""
    stats = {tag: torch.as_tensor(value, device=device).detach() for tag, value in stats.items()}
    for tag, value in stats.items():  # (a seed's own number of a stacked x: run.each(fn, x))
        if value.numel() != k:
            each = "a number" if k == 1 else f"one number per seed under --num-seeds {k} (by run.each(fn, x))"
            raise UsageError(f"stats[{tag!r}] has shape {tuple(value.shape)}; run.log takes {each}")
    return torch.stack(list(stats.values()), -1).reshape(k, -1).float()


class PerRank:
    """State each torchrun rank keeps its own of, as its envs: `run.start(..., hidden=PerRank(hidden))`."""

    def __init__(self, value):
        self.value = value


def check_objects(objects: dict, args, k: int) -> None:
    if odd := [k for k, v in objects.items() if k != "envs" and not (torch.is_tensor(v) or hasattr(v, "state_dict"))]:
        raise UsageError(f"run.start({odd[0]}=...) must be a tensor or have a state_dict(), for --resume")
    optimizer, groups = objects["optimizer"], objects["optimizer"].param_groups
    if any("initial_lr" in group for group in groups):  # what an lr_scheduler sets
        if not any(getattr(obj, "optimizer", None) is optimizer for obj in objects.values()):
            raise UsageError(
                "a torch.optim.lr_scheduler drives the optimizer: give it to run.start(..., "
                "scheduler=scheduler), or a --resume would start its schedule over"
            )
        if getattr(args, "anneal_lr", False):  # train()'s annealing would set the rate over the scheduler's
            raise UsageError("a torch.optim.lr_scheduler and --anneal-lr both set the rate: pass --no-anneal-lr")
        if args.sweep:  # its runs' rates are one tensor of them all, which torch's schedulers cannot fill
            raise UsageError("--sweep with a torch.optim.lr_scheduler: torch's schedulers set one rate for every run")
    if k == 1 and getattr(args, "anneal_lr", False) and not all(torch.is_tensor(g["lr"]) for g in groups):
        fix = "lr=torch.tensor(args.learning_rate, device=device), or pass --no-anneal-lr"  # (K > 1: Stacked says it)
        raise UsageError(f"--anneal-lr sets {type(optimizer).__name__}'s rate in place: give it a tensor, {fix}")
    kinds = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
    dropouts = [m for v in objects.values() if isinstance(v, nn.Module) for m in v.modules() if isinstance(m, kinds)]
    if k > 1 and args.compile and args.device == "cpu" and dropouts:  # docs/modifying.md#the-agent
        raise UsageError(
            f"--num-seeds with --compile: torch 2.13's CPU compiler uses {type(dropouts[0]).__name__}'s masks before"
            " drawing them in the stacked graph, and training goes silently wrong; leave out --compile"
        )
    if k > 1 and (bare := [name for name, v in objects.items() if torch.is_tensor(v)]):
        raise UsageError(
            f"--num-seeds: run.start({bare[0]}=...), a tensor, cannot be each seed's own in the stacked call: make it a"
            " buffer of the agent or of a module given to run.start (docs/modifying.md#many-seeds)"
        )
