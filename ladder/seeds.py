"""--num-seeds K: K seeds' `train()` in one process, each in a thread taking turns, the iteration one call for all of
them, vmapped over their stacked state; a run folder per seed, and their aggregate in a folder of its own."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
import traceback
from dataclasses import asdict, replace
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from tqdm import tqdm

from ladder.checkpoint import read_summary
from ladder.cli import UsageError
from ladder.compile import compiled
from ladder.cuda_graph import CudaGraph
from ladder.run import Run, stop_after_this_iteration
from ladder.statistics import aggregate, line


def train_seeds(train, args) -> list:
    """`train(args)`, or --num-seeds K > 1 seeds in this process (`Seeds`): a run folder each, their aggregate."""
    return [train(args)] if args.num_seeds == 1 else Seeds(args).train(train)


class Seeds:
    """--num-seeds K: `train` as written, for each seed in a thread of its own. The threads take turns (one runs at a
    time, with its own torch RNG state), so each is one seed's run; a function given to `stack` waits until every
    seed has called it, then runs once for all: torch.func.vmap over their stacked tensors (the modules' parameters,
    buffers and attributes, the optimizer's state and rate, the inputs), the results handed back to each seed."""

    current: Optional[Seeds] = None  # while K seeds train

    def __init__(self, args):
        if dist.is_initialized():
            raise UsageError("--num-seeds stacks the seeds in one process: under torchrun, use --num-seeds 1")
        k, first = args.num_seeds, args.seed  # with --resume/--load-model: the K seeds' folders, from their aggregate
        dirs = (read_summary(args.resume or args.load_model) or {}).get("run_dirs")
        if (args.resume or dirs) and len(dirs or []) != k:
            flag = "--resume" if args.resume else "--load-model"
            raise UsageError(
                f"{flag} with --num-seeds {k} takes the aggregate folder of {k} seeds (runs/..__{first}-"
                f"{first + k - 1}__..), or --load-model one model for all"
            )
        self.dir = args.resume or os.path.join(
            "runs", f"{args.env_id}__{args.exp_name}__{first}-{first + k - 1}__{int(time.time())}"
        )
        group = args.wandb_group or os.path.basename(os.path.normpath(self.dir))  # --track: a W&B run per seed
        self.args = [self.seed_args(args, i, dirs, group) for i in range(k)]
        self.flags, self.dirs = args, list(dirs) if args.resume else [None] * k
        ended = {i for i, d in enumerate(self.dirs) if d and finished(d, args)}  # --resume: a seed whose run has ended
        self.live, self.pending, self.results, self.errors = set(range(k)) - ended, {}, {}, {}
        if args.resume and not self.live:  # as `Run.start` says for one seed
            raise UsageError(f"--resume {args.resume}: each seed has ended; raise --total-timesteps or --target-return")
        self.cond, self.local, self.abort = threading.Condition(), threading.local(), False
        self.turn = min(self.live, default=0)  # the seed whose Python runs now
        self.entries, self.runs, self.agents = [[] for _ in range(k)], [None] * k, [None] * k
        self.rngs, self.calls, self.signal = [None] * k, {}, 0

    @staticmethod
    def seed_args(args, i: int, dirs: Optional[list], group: str):
        """Seed i's flags: a one-seed run of its own (resumable alone); seed 1 films and shows the progress bar."""
        resume, model = args.resume and dirs[i], dirs[i] if dirs and args.load_model else args.load_model
        first = dict(capture_video=args.capture_video and i == 0, progress_bar=args.progress_bar and i == 0)
        return replace(
            args, seed=args.seed + i, num_seeds=1, resume=resume, load_model=model, wandb_group=group, **first
        )

    def train(self, train) -> list:
        """Run the K seeds to their ends; write and print their aggregate; raise the first seed's error, if any."""
        Seeds.current, main = self, threading.current_thread() is threading.main_thread()
        threads = [
            threading.Thread(target=self.run_seed, args=(i, train), name=f"seed {a.seed}", daemon=True)
            for i, a in enumerate(self.args)
            if i in self.live
        ]
        handlers = {s: signal.signal(s, self.stop) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():  # in short waits: the signal handler runs in between
                    try:
                        thread.join(0.1)
                    except KeyboardInterrupt:  # a second Ctrl-C: every seed stops at once
                        with self.cond:
                            self.abort = True
                            self.cond.notify_all()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            Seeds.current = None
        self.write_aggregate(final=True)
        for i in sorted(self.errors):
            raise self.errors[i]
        return self.agents

    def stop(self, signum: int, frame) -> None:
        """SIGINT/SIGTERM: every seed stops after the same iteration (the next stacked call), with a checkpoint."""
        self.signal = self.signal or signum
        stop_after_this_iteration(signum, lambda message: tqdm.write(f"note: {message}"))

    def run_seed(self, i: int, train) -> None:
        """Thread i: seed i's `train`, in its turns."""
        self.local.i = i
        try:
            with self.cond:
                self.cond.wait_for(lambda: self.turn == i or self.abort)
            if self.abort:
                raise KeyboardInterrupt
            self.agents[i] = train(self.args[i])
        except BaseException as e:  # its Run has written its outputs
            self.errors[i] = e
        finally:
            with self.cond:
                self.live.discard(i)
                self.pass_turn(i)

    def stack(self, fn, run, optimizer, *state):
        """`fn`, an iteration's device work (its `state`: the modules and envs whose tensors it reads and changes), as
        each seed calls it: the seed waits for the others, then one call runs for all, on their stacked tensors."""
        i = self.local.i
        for name in [k for k, v in run.stateful.items() if torch.is_tensor(v)][:1]:  # read as seed 1's by all seeds
            raise UsageError(
                f"--num-seeds: run.start({name}=...), a tensor, cannot be each seed's own in the stacked "
                "call: make it a buffer of the agent or of a module given to run.start (docs/modifying.md#many-seeds)"
            )
        self.entries[i].append((fn, optimizer, run.holding(state)))  # a module given to run.start: each seed's own
        self.runs[i], j = run, len(self.entries[i]) - 1

        @functools.wraps(fn)
        def call(*args):
            with self.cond:
                self.rngs[i], self.pending[i] = rng_state(), (j, args)
                self.pass_turn(i)
                self.cond.wait_for(lambda: self.turn == i or self.abort)
                if self.abort:
                    raise KeyboardInterrupt
                rng_state(self.rngs[i])
                out = self.results.pop(i)
            if isinstance(out, BaseException):
                raise out
            return out

        return call

    def pass_turn(self, i: int) -> None:
        """Seed i waits or has ended: the next seed in order runs; when all wait, their calls run (in this thread)."""
        waiting = [k for k in sorted(self.live) if k not in self.pending]
        if not waiting and self.pending:
            self.write_aggregate(final=False)
            calls, self.pending, lead = self.pending, {}, min(self.pending)
            for run in filter(None, self.runs):  # a signal: every seed stops after this iteration
                run.stop_signal = run.stop_signal or self.signal
            rng_state(self.rngs[lead])  # the calls draw (minibatch orders, dropout) from the first seed's stream,
            for j in sorted({j for j, _ in calls.values()}):
                seeds = [k for k in sorted(calls) if calls[k][0] == j]
                try:
                    self.results.update(zip(seeds, self.call_stacked(j, seeds, [calls[k][1] for k in seeds])))
                except Exception as e:  # every seed in the call raises it
                    self.results.update((k, e) for k in seeds)
            self.rngs[lead] = rng_state()  # which its checkpoints keep
            waiting = sorted(self.live)
        self.turn = next((k for k in waiting if k > i), waiting[0] if waiting else None)
        self.cond.notify_all()

    def call_stacked(self, j: int, seeds: list[int], calls: list[tuple]) -> list:
        """The j-th function the seeds gave `stack`, called once on their stacked tensors; each seed's results."""
        entries = [self.entries[k][j] for k in seeds]
        slots = [state_slots(optimizer, state) for _, optimizer, state in entries]
        flat = [pytree.tree_flatten(args) for args in calls]
        if any(len(s) != len(slots[0]) for s in slots) or any(spec != flat[0][1] for _, spec in flat):
            raise UsageError(f"--num-seeds: the seeds' {entries[0][0].__name__} differ in their state or arguments")
        where = [n for n, x in enumerate(flat[0][0]) if torch.is_tensor(x)]
        device = self.runs[seeds[0]].device
        values = [
            torch.stack([torch.as_tensor(get_slot(t, key), device=device) for t, key in column])
            for column in zip(*slots)
        ]
        inputs = [torch.stack([leaves[n] for leaves, _ in flat]) for n in where]
        key = (j, tuple(seeds))
        if key not in self.calls:
            self.calls[key] = self.vmapped(entries, slots[0], flat[0], where)
        out, new = self.calls[key](values, inputs)
        with torch.no_grad():  # what the call wrote, into the seeds' own tensors (in place: a Parameter is known by
            for n, seed_slots in enumerate(slots):  # its identity), inputs first: one may be a holder's tensor
                for m, value in zip(where, inputs):
                    flat[n][0][m].copy_(value[n])
                for (t, name), value in zip(seed_slots, new):
                    mine = get_slot(t, name)
                    if not torch.is_tensor(mine):  # a rate given as a float: the call only read it
                        continue
                    fits = mine.shape == value[n].shape and mine.dtype == value[n].dtype
                    mine.copy_(value[n]) if fits else set_slot(t, name, value[n].clone())
        return [pytree.tree_map(lambda x, n=n: x[n], out) for n in range(len(seeds))]

    def vmapped(self, entries, slots, flat, where):
        """The first seed's function on all the seeds' tensors: its slots set to the stacked ones (vmap shows each as
        one seed's) while it runs, the inputs written in place; with --compile one graph, on a GPU a CUDA graph."""
        fn, _, state = entries[0]
        theirs = {id(h): mine for _, _, hs in entries for h, mine in zip(hs, state)}  # an argument that is a holder
        leaves = [theirs.get(id(x), x) for x in flat[0]]

        def body(values, inputs):
            originals = [get_slot(t, key) for t, key in slots]
            for (t, key), value in zip(slots, values):
                set_slot(t, key, value)
            args = list(leaves)  # a copy: a list the call fills would leak what vmap shows as one seed's
            for n, x in zip(where, inputs):
                args[n] = x
            try:
                return fn(*pytree.tree_unflatten(args, flat[1])), [get_slot(t, key) for t, key in slots]
            finally:
                for (t, key), value in zip(slots, originals):
                    set_slot(t, key, value)

        stacked, stand_in = torch.func.vmap(body, randomness="different"), torch.zeros(())
        stacked = compiled(stacked) if self.flags.compile else stacked

        def call(values, inputs):  # a rate given as a float waits outside, a tensor in its place: compiled code would
            floats = [(t, key, get_slot(t, key)) for t, key in slots if not torch.is_tensor(get_slot(t, key))]
            for t, key, _ in floats:  # put the float back as a constant, and compile again when it changes
                set_slot(t, key, stand_in)
            try:
                return stacked(values, inputs)
            except RuntimeError as e:  # what vmap cannot do: a host read, a branch on a value, backward() (functorch's)
                if "vmap" not in str(e) and "functorch" not in str(e):
                    raise
                torch_dir = os.path.dirname(torch.__file__)
                tb = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(torch_dir)]
                raise UsageError(
                    f"--num-seeds: {str(e).splitlines()[0][:160]} ({tb[-1].filename}:{tb[-1].lineno}); "
                    "see docs/modifying.md#many-seeds"
                ) from None
            finally:
                for t, key, value in floats:
                    set_slot(t, key, value)

        run, call.__name__ = next(r for r in self.runs if r is not None), f"{fn.__name__} of {len(entries)} seeds"
        return CudaGraph(call, run) if run.device.type in CudaGraph.devices else call

    def write_aggregate(self, final: bool) -> None:
        """The aggregate folder's summary.json: the seeds' run folders (--resume it), and at the end their aggregate."""
        if os.path.isfile(path := os.path.join(self.dir, "summary.json")) and not final:
            return
        dirs = [run.dir if run is not None else d for run, d in zip(self.runs, self.dirs)]
        summaries = [summary for summary in map(read_summary, dirs if final else []) if summary is not None]
        agg = aggregate(summaries) if summaries else {}
        os.makedirs(self.dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"run_dirs": dirs, "num_seeds": len(dirs), **agg, "args": asdict(self.flags)}, f, indent=2)
        if final and summaries:
            if any(s["status"] == "interrupted" for s in summaries):  # main's last line: --resume the aggregate
                Run.resumable = self.dir
            print(f"{len(dirs)} seeds: {line(agg)}; outputs in {self.dir}")


def finished(run_dir: str, args) -> bool:
    """Whether `run_dir`'s run has ended as `args` would end it (`Run.start` would refuse it): --resume leaves it."""
    s = read_summary(run_dir) or {"status": None}
    done = s["status"] == "completed" and s["args"]["total_timesteps"] >= args.total_timesteps
    return done or s["status"] == "target return reached" and s["args"]["target_return"] == args.target_return


def state_slots(optimizer, state) -> list[tuple]:
    """Where a seed's state lives, as (table, key): its modules' parameters and buffers, its other objects' (envs')
    tensor attributes, its optimizer's per-parameter state and learning rates."""
    modules = [m for obj in state if isinstance(obj, nn.Module) for m in obj.modules()]
    tables = [m._parameters for m in modules] + [m._buffers for m in modules]
    tables += [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]] if optimizer else []
    slots = [(t, key) for t in tables for key, v in t.items() if torch.is_tensor(v)]
    objects = [obj for obj in state if not isinstance(obj, nn.Module)]
    slots += [(obj, key) for obj in objects for key, v in vars(obj).items() if torch.is_tensor(v)]
    return slots + [(group, "lr") for group in (optimizer.param_groups if optimizer else [])]


def get_slot(table, key):
    """A dict's entry or an object's attribute (set as the code sets it: dynamo tracks the two apart)."""
    return table[key] if isinstance(table, dict) else getattr(table, key)


def set_slot(table, key, value) -> None:
    table.__setitem__(key, value) if isinstance(table, dict) else setattr(table, key, value)


def rng_state(state=None):
    """torch's global RNG state (CPU and CUDA), or, given one, set to it."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if state is None:
        return torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
