"""`Run`: what `train()` calls (its seeds, start, iterations, logs and end); behind it seeds.py, seed.py, stacked.py,
outputs.py, progress.py and signals.py."""

import contextlib
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm import tqdm

from ladder.cuda_graph import CudaGraph
from ladder.flags import UsageError
from ladder.seeds import Seeds
from ladder.signals import Signals


class Run(contextlib.AbstractContextManager):
    """A run (runs/{env_id}__{exp_name}__{seed}__{time}; K seeds: K and an aggregate), start to end. The script's
    `evaluate(agent, envs, args, video)` returns episodes' returns; `record_video(agent, envs, rollout, args, path)`."""

    def __init__(self, args, evaluate, record_video):
        self.args, self.evaluate, self.record_video, self.k = args, evaluate, record_video, args.num_seeds
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.all = Seeds(args, self.rank, self.world_size)  # the run's seeds: one, or K
        self.progress, self.runs, self.dir, self.looping, self.stopping = self.all.progress, self.all.runs, None, 0, 0
        self.first_iteration, self.clock, self.setup = 1, time.perf_counter(), {}  # setup: summary.json's setup_parts
        self.signals = Signals(self.note, lambda: args.compile and self.progress.iteration < self.first_iteration)

    def seeds(self):
        """`for seed in run.seeds():` around the set-up, which builds each seed's objects up to its `run.start`."""
        yield from (flags.seed for flags in self.all.flags)

    def start(self, agent: nn.Module, envs, optimizer: torch.optim.Optimizer, total_steps: int, obs=None, **stateful):
        """A seed's objects (`stateful`: yours by name, tensors or objects with a state_dict), restored by --resume or
        --load-model; the last seed's stacks the K seeds and starts the clock. Returns `obs` or the envs' (stacked)."""
        objects = {"agent": agent, "envs": envs, "optimizer": optimizer}
        objects |= {k: v.value if isinstance(v, PerRank) else v for k, v in stateful.items() if v is not None}
        check_objects(objects, self.args)
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
        self.setup["built"], self.clock = time.perf_counter() - self.clock, time.perf_counter()
        return obs

    def each(self, fn, *args):
        """`fn(*args)`, a seed's own (its noise, its rollout buffer); --num-seeds K: vmapped over the K, stacked."""
        return fn(*args) if self.k == 1 else self.stack.call(fn, *args)

    def one_by_one(self, fn, *args):
        """`fn(*args)`; --num-seeds K: for each seed on its own objects in turn (Brax's JAX envs), stacked."""
        return fn(*args) if self.k == 1 else self.stack.one_by_one(fn, *args)

    def stacked(self, fn):
        """`fn`, an iteration's device work, as one call for the K seeds (vmapped, --compile'd; GPU: a CUDA graph)."""
        call = lambda *args: self.stack.call(fn, *args, compile=self.args.compile)
        call.__name__ = f"{fn.__name__} of {self.k} seeds"
        return CudaGraph(call, self) if self.device.type in CudaGraph.devices else call

    def note(self, message: str) -> None:
        """One line to stderr that does not break the progress bar (rank 0's only, under torchrun)."""
        if self.rank == 0:
            tqdm.write(f"note: {message}", file=sys.stderr)

    def log(self, env_steps: int, stats: dict[str, torch.Tensor], episodes, rollout=None) -> bool:
        """An iteration's logs, in one host read for all seeds and ranks: `episodes` (ended, return, length), tensors
        of one shape. FloatingPointError on a NaN loss; True once every seed is at the target."""
        for tag, value in stats.items():  # a number each (a seed's own sum of a stacked x: x.flatten(1).sum(1))
            if value.numel() != self.k:
                each = "a number" if self.k == 1 else f"one number per seed under --num-seeds {self.k}"
                raise UsageError(f"stats[{tag!r}] has shape {tuple(value.shape)}; run.log takes {each}")
        lr = torch.as_tensor(self.optimizer.param_groups[0]["lr"], dtype=torch.float32, device=self.device)
        head = torch.cat((torch.tensor([env_steps, self.signals.received], device=self.device), lr.reshape(1)))
        values = torch.stack(list(stats.values()), -1).reshape(self.k, -1).float()
        episodes = torch.cat([x.reshape(self.k, -1).float() for x in episodes], 1)  # (ended, return, length)
        numbers = torch.cat((head.expand(self.k, 3), values, episodes), 1).cpu().numpy()  # the one host read
        if self.world_size > 1:  # every rank's numbers, to every rank
            dist.all_gather_object(ranks := [None] * self.world_size, numbers[0])
            numbers = of_all_ranks(ranks, len(stats))
        p, now, a = self.progress, time.perf_counter(), self.args
        compiling = a.compile and p.iteration + 1 == self.first_iteration  # LeanRL's burn-in: not training time
        tags, columns = p.record(numbers, list(stats), None if compiling else now - self.clock, self.threshold)
        if compiling:
            self.note(f"--compile: iteration {p.iteration} took {now - self.clock:.1f} s (compilation), not counted")
            self.setup["compiled"] = now - self.clock
        self.clock, mean = now, p.mean()
        for seed in np.nonzero((mean >= a.target_return) & ~p.target_reached)[0] if a.target_return is not None else ():
            ok, seconds = self.all.confirmed(self.runs[seed], mean[seed], self.evaluate, self.note, self.device)
            p.target_reached[seed], self.clock = ok, self.clock + seconds  # a seed of K trains on; not training time
        if self.rank == 0:  # the outputs (a video, TensorBoard) are not training time either
            self.all.report(tags, columns, int(numbers[0, 0]), self.total_steps, self.record_video, rollout)
            self.clock = time.perf_counter()
        self.stopping = int(numbers[:, 1].max())  # the ranks stop together
        if not self.looping:  # log called from a loop of the code's own: the end of the iteration is now
            self.end_of_iteration()
        return bool(p.target_reached.all())

    def iterations(self):
        """The iterations left (numbered on from a checkpoint's), `run.log` once in each. After the whole loop body (a
        scheduler's step too), the checkpoint is written when due and a signal stops the run."""
        if len(self.runs) < self.k:
            raise UsageError(f"--num-seeds {self.k}: build each seed's objects in `for seed in run.seeds():`")
        self.looping = True
        try:
            while self.progress.global_step < self.total_steps:
                logged = self.progress.iteration
                yield logged + 1
                if self.progress.iteration == logged:
                    raise UsageError("train() must call run.log(...) once in each iteration of run.iterations()")
                self.end_of_iteration()
        finally:
            self.looping = False

    def end_of_iteration(self) -> None:
        """The checkpoint every `checkpoint-interval` iterations, then KeyboardInterrupt(signal) if a signal came."""
        if self.args.checkpoint_interval and self.progress.iteration % self.args.checkpoint_interval == 0:
            self.all.checkpoint(self.note)
        if self.stopping:
            raise KeyboardInterrupt(self.stopping)

    def __exit__(self, exc_type, exc, tb) -> None:  # None: an exception goes on to main
        """Each seed's end, then their aggregate; a signal now ends only the final evaluation."""
        try:
            stopped = bool(self.signals.received)
            self.all.finish(exc_type, exc, stopped, self.setup, self.evaluate, self.note)
        finally:
            self.signals.restore()


class PerRank:
    """State each torchrun rank keeps its own of, as its envs: `run.start(..., hidden=PerRank(hidden))`."""

    def __init__(self, value):
        self.value = value


def of_all_ranks(ranks: list, n: int) -> np.ndarray:
    """The torchrun ranks' rows of `log` as one: steps summed, any's stop signal, mean losses, all episodes."""
    head = [sum(r[0] for r in ranks), max(r[1] for r in ranks), ranks[0][2]]
    episodes = np.concatenate([r[3 + n :].reshape(3, -1) for r in ranks], axis=1).reshape(-1)
    return np.concatenate((head, np.mean([r[3 : 3 + n] for r in ranks], axis=0), episodes))[None]


def check_objects(objects: dict, args) -> None:
    """What `run.start` is given, checked before anything is built on it (one line each)."""
    if odd := [k for k, v in objects.items() if k != "envs" and not (torch.is_tensor(v) or hasattr(v, "state_dict"))]:
        raise UsageError(f"run.start({odd[0]}=...) must be a tensor or have a state_dict(), for --resume")
    optimizer = objects["optimizer"]
    if any("initial_lr" in group for group in optimizer.param_groups):  # what an lr_scheduler sets
        if not any(getattr(obj, "optimizer", None) is optimizer for obj in objects.values()):
            raise UsageError(
                "a torch.optim.lr_scheduler drives the optimizer: give it to run.start(..., "
                "scheduler=scheduler), or a --resume would start its schedule over"
            )
        if getattr(args, "anneal_lr", False):  # train()'s annealing would set the rate over the scheduler's
            raise UsageError("a torch.optim.lr_scheduler and --anneal-lr both set the rate: pass --no-anneal-lr")
    kinds = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
    dropouts = [m for v in objects.values() if isinstance(v, nn.Module) for m in v.modules() if isinstance(m, kinds)]
    if args.num_seeds > 1 and args.compile and args.device == "cpu" and dropouts:  # docs/modifying.md#the-agent
        raise UsageError(
            f"--num-seeds with --compile: torch 2.13's CPU compiler uses {type(dropouts[0]).__name__}'s masks before"
            " drawing them in the stacked graph, and training goes silently wrong; leave out --compile"
        )
    if args.num_seeds > 1 and (bare := [k for k, v in objects.items() if torch.is_tensor(v)]):
        raise UsageError(
            f"--num-seeds: run.start({bare[0]}=...), a tensor, cannot be each seed's own in the stacked call: make it a"
            " buffer of the agent or of a module given to run.start (docs/modifying.md#many-seeds)"
        )
