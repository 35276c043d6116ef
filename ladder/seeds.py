"""--num-seeds K: K seeds' runs in one process, no thread per seed. `train()` runs once for all of them: each seed's
objects are built by its own `train()` up to `run.start` (a run folder each), their tensors stacked into [K, ...]
ones that an iteration's device work, vmapped, advances in one call; the seeds' logs come from one host read."""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from dataclasses import asdict, replace
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from ladder.checkpoint import read_summary, save_checkpoint
from ladder.cli import UsageError
from ladder.compile import compiled
from ladder.cuda_graph import CudaGraph
from ladder.run import Run
from ladder.statistics import aggregate, line


def train_seeds(train, args) -> list:
    """`train(args)`, or --num-seeds K > 1 seeds in this process (`Seeds`): a run folder each, their aggregate."""
    if args.num_seeds == 1:
        return [train(args)]
    seeds = Seeds(args, train)
    Seeds.current = seeds
    try:  # the lead: train() as written, on the stacked state; its Run drives the seeds' runs
        train(replace(args, resume=None, load_model=None, track=False, capture_video=False, progress_bar=False))
    finally:
        Seeds.current = None
    return [run.agent for run in seeds.runs]


class Built(BaseException):
    """(run, obs): a seed's `run.start` while the seeds are built, its `train()` ended there (not an Exception: a
    copy's `except Exception` must not catch it)."""


class Seeds:
    """--num-seeds K: the seeds' runs (`runs`, a run folder each) and the stacked tensors their iterations advance.
    The lead's `train()` calls `start` (through its `run.start`), `stack` for the iteration's device work, `each` for
    what each seed draws from its own generators, and `log` (through `run.log`) once per iteration."""

    current: Optional[Seeds] = None  # while K seeds train

    def __init__(self, args, train):
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
        if args.resume and all(finished(d, args) for d in dirs):  # as `Run.start` says for one seed
            raise UsageError(f"--resume {args.resume}: each seed has ended; raise --total-timesteps or --target-return")
        self.dir = args.resume or os.path.join(
            "runs", f"{args.env_id}__{args.exp_name}__{first}-{first + k - 1}__{int(time.time())}"
        )
        group = args.wandb_group or os.path.basename(os.path.normpath(self.dir))  # --track: a W&B run per seed
        self.args = [seed_args(args, i, dirs, group) for i in range(k)]
        self.flags, self.train, self.building = args, train, None  # `building`: the seed whose train() runs now
        self.runs: list[Run] = []
        self.rngs: list = []  # each seed's torch RNG state while another's is live (seed 1's: the stacked calls')
        self.slots, self.values = [], []  # the lead's (table, key) and the stacked tensors, [K, ...], there
        self.seed_slots, self.views = [], []  # each seed's (table, key) and its views of the stacked tensors

    def start(self, lead: Run):
        """The lead's `run.start`: each seed's `train()` up to its own `run.start` (its run folder, --resume, its
        weights from its seed); their observations, stacked. The lead's RNG goes on as seed 1's."""
        self.lead, observations = lead, []
        for i, args in enumerate(self.args):
            self.building = i
            try:
                self.train(args)
                raise UsageError("--num-seeds: train() must call run.start(...) before its iterations")
            except Built as built:
                self.runs.append(built.args[0])
                self.rngs.append(rng_state())
                observations.append(built.args[1])
            finally:
                self.building = None
        now, counters = time.perf_counter(), [run.counters["iteration"] for run in self.runs]
        if len(set(counters)) > 1:
            raise UsageError(
                f"--resume {self.flags.resume}: its seeds stopped at different iterations ({counters}); "
                "resume each seed's folder alone"
            )
        for run in self.runs:  # their set-up ends with the last seed's
            run.setup_seconds, run.clock = now - run.clock, now
        for group, first in zip(lead.optimizer.param_groups, self.runs[0].optimizer.param_groups):  # --resume: as
            group.update({key: value for key, value in first.items() if key != "params"})  # the seeds' were saved
        for name, obj in plain_objects(lead).items():  # (a scheduler: in step for all seeds)
            obj.load_state_dict(self.runs[0].stateful[name].state_dict())
        lead.counters, lead.total_steps, lead.dir = dict(self.runs[0].counters), self.runs[0].total_steps, self.dir
        rng_state(self.rngs[0])
        self.write_aggregate(final=False)
        return None if observations[0] is None else torch.stack(observations)

    def stack(self, fn, run: Run, optimizer, *state):
        """`fn`, an iteration's device work, as one call for all seeds: torch.func.vmap over their stacked tensors, that
        it changes in place. The first call stacks the seeds' whole state (the modules' parameters and buffers, the
        envs' tensor attributes, the optimizer's state, the objects given to run.start), for `each` too; `optimizer`,
        `state`: as a CudaGraph takes them (the rates `fn` reads are the optimizer's, alike for all seeds)."""
        for name in [k for k, v in run.stateful.items() if torch.is_tensor(v)][:1]:
            raise UsageError(
                f"--num-seeds: run.start({name}=...), a tensor, cannot be each seed's own in the stacked "
                "call: make it a buffer of the agent or of a module given to run.start (docs/modifying.md#many-seeds)"
            )
        if not self.slots:
            self.stack_state(run)
        return self.vmapped(fn, run, optimizer.param_groups if optimizer is not None else [])

    def stack_state(self, run: Run) -> None:
        """The seeds' tensors stacked, [K, ...], in the lead's places (code outside the calls, an annealed buffer, acts
        on all); each seed's own, views of them."""
        held = run.holding((run.agent, run.envs))
        for seed in self.runs:  # state the lead's step made (Adam's, at its build) and a seed has not: the lead's
            for lead_p, p in zip(params(run.optimizer), params(seed.optimizer)):
                for key, value in run.optimizer.state[lead_p].items():
                    seed.optimizer.state[p].setdefault(key, value.clone())
        self.slots = state_slots(run.optimizer, held)
        theirs = [[self.counterparts(k).get(id(obj), obj) for obj in held] for k in range(len(self.runs))]
        self.seed_slots = [state_slots(seed.optimizer, objects) for seed, objects in zip(self.runs, theirs)]
        if any([key for _, key in mine] != [key for _, key in self.slots] for mine in self.seed_slots):
            raise UsageError("--num-seeds: the seeds' agents, envs or optimizers differ in their tensors")
        with torch.no_grad():
            self.values = [
                torch.stack([get_slot(*mine[j]) for mine in self.seed_slots]) for j in range(len(self.slots))
            ]
        self.views = [[value[k] for value in self.values] for k in range(len(self.runs))]
        for slots, values in zip([self.slots, *self.seed_slots], [self.values, *self.views]):
            for slot, value in zip(slots, values):
                point(*slot, value)

    def counterparts(self, k: int) -> dict:
        """Seed k's objects by the id of the lead's in their places (the agent, envs, optimizer, state by name)."""
        lead, seed = self.lead, self.runs[k]
        pairs = {id(lead.agent): seed.agent, id(lead.envs): seed.envs, id(lead.optimizer): seed.optimizer}
        return pairs | {id(v): seed.stateful[name] for name, v in lead.stateful.items() if name in seed.stateful}

    def vmapped(self, fn, run: Run, groups):
        """`fn` on the stacked tensors: the lead's slots set to them (vmap shows each as one seed's) while it runs, the
        tensors given stacked, the learning rates (alike for all seeds) as tensors; --compile: one graph, on a GPU a
        CUDA graph; one for each layout of the arguments (their other values: its agent, envs, a chunk's length)."""
        slots, values, k, built = self.slots, self.values, len(self.runs), {}

        def build(leaves: list, spec):
            def body(values, tensors, rates):
                originals = [get_slot(t, key) for t, key in slots] + [group["lr"] for group in groups]
                for (t, key), value in zip(slots, values):
                    set_slot(t, key, value)
                for group, rate in zip(groups, rates):
                    group["lr"] = rate
                args, tensors = list(leaves), iter(tensors)  # a copy: vmap shows the tensors as one seed's
                try:
                    args = [next(tensors) if torch.is_tensor(x) else x for x in args]
                    return fn(*pytree.tree_unflatten(args, spec)), [get_slot(t, key) for t, key in slots]
                finally:
                    for (t, key), value in zip(slots, originals):
                        set_slot(t, key, value)
                    for group, value in zip(groups, originals[len(slots) :]):
                        group["lr"] = value

            batched = torch.func.vmap(body, in_dims=(0, 0, None), randomness="different")
            batched = compiled(batched) if self.flags.compile else batched

            def call(values, tensors, rates):
                try:
                    return batched(values, tensors, rates)
                except RuntimeError as e:  # what vmap cannot do: a host read, a branch on a value, backward()
                    if "vmap" not in str(e) and "functorch" not in str(e) and "batched" not in str(e):
                        raise
                    torch_dir = os.path.dirname(torch.__file__)
                    tb = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(torch_dir)]
                    raise UsageError(
                        f"--num-seeds: {str(e).splitlines()[0][:160]} ({tb[-1].filename}:{tb[-1].lineno}); "
                        "see docs/modifying.md#many-seeds"
                    ) from None

            call.__name__ = f"{fn.__name__} of {k} seeds"
            return CudaGraph(call, run) if run.device.type in CudaGraph.devices else call

        def one_call(*args):
            self.sync()
            leaves, spec = pytree.tree_flatten(args)
            for x in leaves:
                if torch.is_tensor(x) and not stacked(x, k):
                    raise UsageError(
                        f"--num-seeds: every tensor given to the stacked {fn.__name__} must be the {k} seeds' own, "
                        f"stacked (shape [{k}, ...]); make it with run.each(...) (docs/modifying.md#many-seeds)"
                    )
            layout = (
                str(spec),
                *(id(x) if not isinstance(x, (int, float)) else x for x in leaves if not torch.is_tensor(x)),
            )
            if layout not in built:
                built[layout] = build(leaves, spec)
            rates = [torch.as_tensor(group["lr"], dtype=torch.float32, device=run.device) for group in groups]
            out, new = built[layout](values, [x for x in leaves if torch.is_tensor(x)], rates)
            with torch.no_grad():  # what the call left in the state (an env's out-of-place step), into the stacked
                for value, changed in zip(values, new):
                    if changed is not value:
                        value.copy_(changed)
            return out

        return one_call

    def each(self, fn, *args):
        """`fn(*args)` for each seed: its objects in the lead's places (in `args`, and the lead's stacked tensors its
        own), a stacked tensor in `args` its row, its RNG live; the results stacked."""
        k_seeds, outs = len(self.runs), []
        self.sync()
        for k in range(k_seeds):
            pairs = self.counterparts(k)
            mine = [x[k] if stacked(x, k_seeds) else pairs.get(id(x), x) for x in pytree.tree_leaves(args)]
            with self.as_seed(k), self.in_place_of_lead(k):
                outs.append(fn(*pytree.tree_unflatten(mine, pytree.tree_structure(args))))
        leaves, spec = zip(*map(pytree.tree_flatten, outs))
        rows = [torch.stack(column) if torch.is_tensor(column[0]) else column[0] for column in zip(*leaves)]
        return pytree.tree_unflatten(rows, spec[0])

    @contextlib.contextmanager
    def in_place_of_lead(self, k: int):
        """The lead's stacked tensors are seed k's own while `each` calls for it (a function bound to the lead's
        agent works on seed k's); what the call put in their place, or in seed k's, is copied into the stack."""
        if not self.slots:  # not stacked yet
            yield
            return
        lead = [get_slot(*slot) for slot in self.slots]
        for slot, view in zip(self.slots, self.views[k]):
            set_slot(*slot, view)
        try:
            yield
        finally:
            for slot, view, mine, original in zip(self.slots, self.views[k], self.seed_slots[k], lead):
                for table, key in (slot, mine):
                    keep(table, key, view)
                set_slot(*slot, original)

    def sync(self) -> None:
        """A stacked tensor the lead's code replaced (out of place, between calls), copied into the stack."""
        for (table, key), value in zip(self.slots, self.values):
            keep(table, key, value)

    def sync_objects(self) -> None:
        """The stacked tensors (`sync`), the lead's rates and each object given to run.start that holds none (a
        scheduler: the lead's steps it for all seeds) as the lead's, in each seed's place: as the checkpoint must have
        them at the end of the iteration, after a scheduler's step that follows `run.log`."""
        self.sync()
        for run in self.runs:
            copy_rates(self.lead.optimizer, run.optimizer)
            for name, obj in plain_objects(self.lead).items():
                run.stateful[name].load_state_dict(obj.state_dict())

    @contextlib.contextmanager
    def as_seed(self, k: int):
        """Seed k's torch RNG live (seed 1's is live between these, drawn from by the stacked calls)."""
        if k == 0:
            yield
            return
        live = rng_state()
        rng_state(self.rngs[k])
        try:
            yield
        finally:
            self.rngs[k] = rng_state()
            rng_state(live)

    def log(self, lead: Run, numbers, tags: list, rollout) -> bool:
        """The lead's `run.log`, after its one host read: each seed's logs from its row. True once every seed has
        reached the target (one that reaches it first trains on with the others)."""
        self.sync()
        for seed, run in enumerate(self.runs):
            copy_rates(lead.optimizer, run.optimizer)  # as the lead's loop set them: logged
            film = lambda seed=seed: pytree.tree_map(lambda x: x[seed] if torch.is_tensor(x) else x, rollout)
            with self.as_seed(seed):
                run.record([numbers[seed]], tags, film)
        lead.counters["iteration"] += 1
        lead.counters["global_step"] = self.runs[0].counters["global_step"]
        lead.stopping = lead.stop_signal
        return all(run.counters["target_reached"] for run in self.runs)

    def checkpoint(self) -> None:
        """Each seed's checkpoint, with its RNG."""
        self.sync_objects()
        for seed, run in enumerate(self.runs):
            with self.as_seed(seed):
                save_checkpoint(run)

    def finish(self, exc_type, exc) -> None:
        """Each seed's end (its checkpoint, model, evaluation, summary.json), then their aggregate."""
        self.sync_objects() if self.slots else None
        for seed, run in enumerate(self.runs):
            with self.as_seed(seed):
                run.finish(exc_type, exc)
        self.write_aggregate(final=True)

    def write_aggregate(self, final: bool) -> None:
        """The aggregate folder's summary.json: the seeds' run folders (--resume it), and at the end their aggregate."""
        dirs = [run.dir for run in self.runs]
        summaries = [summary for summary in map(read_summary, dirs if final else []) if summary is not None]
        agg = aggregate(summaries) if summaries else {}
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "summary.json"), "w") as f:
            json.dump({"run_dirs": dirs, "num_seeds": len(dirs), **agg, "args": asdict(self.flags)}, f, indent=2)
        if final and summaries:
            if any(s["status"] == "interrupted" for s in summaries):  # main's last line: --resume the aggregate
                Run.resumable = self.dir
            print(f"{len(dirs)} seeds: {line(agg)}; outputs in {self.dir}")


def seed_args(args, i: int, dirs: Optional[list], group: str):
    """Seed i's flags: a one-seed run of its own (resumable alone); seed 1 films and shows the progress bar."""
    resume, model = args.resume and dirs[i], dirs[i] if dirs and args.load_model else args.load_model
    first = dict(capture_video=args.capture_video and i == 0, progress_bar=args.progress_bar and i == 0)
    return replace(args, seed=args.seed + i, num_seeds=1, resume=resume, load_model=model, wandb_group=group, **first)


def plain_objects(run: Run) -> dict:
    """The objects given to `run.start` that hold no tensor (a scheduler), by name: not stacked, the lead's for all."""
    objects = {k: v for k, v in run.stateful.items() if k not in ("agent", "optimizer") and not torch.is_tensor(v)}
    return {
        k: v
        for k, v in objects.items()
        if not isinstance(v, nn.Module) and not any(map(torch.is_tensor, vars(v).values()))
    }


def finished(run_dir: str, args) -> bool:
    """Whether `run_dir`'s run has ended as `args` would end it (`Run.start` would refuse it): --resume leaves it."""
    s = read_summary(run_dir) or {"status": None}
    done = s["status"] == "completed" and s["args"]["total_timesteps"] >= args.total_timesteps
    return done or s["status"] == "target return reached" and s["args"]["target_return"] == args.target_return


def copy_rates(source, target) -> None:
    """`source`'s learning rates into `target`'s param groups."""
    for group, source_group in zip(target.param_groups, source.param_groups):
        group["lr"] = float(source_group["lr"])


def params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def state_slots(optimizer, state) -> list[tuple]:
    """Where a seed's state lives, as (table, key): its modules' parameters and buffers, its other objects' (envs')
    tensor attributes, its optimizer's per-parameter state."""
    modules = [m for obj in state if isinstance(obj, nn.Module) for m in obj.modules()]
    tables = [m._parameters for m in modules] + [m._buffers for m in modules]
    tables += [optimizer.state[p] for p in params(optimizer)] if optimizer else []
    slots = [(t, key) for t in tables for key, v in t.items() if torch.is_tensor(v)]
    objects = [obj for obj in state if not isinstance(obj, (nn.Module, torch.optim.Optimizer))]
    return slots + [(obj, key) for obj in objects for key, v in vars(obj).items() if torch.is_tensor(v)]


def stacked(x, k: int) -> bool:
    """Whether `x` is a tensor of the K seeds' stacked (its first dimension K)."""
    return torch.is_tensor(x) and x.dim() > 0 and x.shape[0] == k


def keep(table, key, view: torch.Tensor) -> None:
    """The tensor at (table, key), if it is no longer `view` (replaced out of place), copied into it; then `view`."""
    value = get_slot(table, key)
    if value.data_ptr() != view.data_ptr() or value.shape != view.shape:
        with torch.no_grad():
            view.copy_(value)
        point(table, key, view)


def point(table, key, view: torch.Tensor) -> None:
    """A seed's tensor at `view` (a Parameter stays itself: an optimizer knows it by identity)."""
    if isinstance(get_slot(table, key), nn.Parameter):
        get_slot(table, key).data = view
    else:
        set_slot(table, key, view)


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
