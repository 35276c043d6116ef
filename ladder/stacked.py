"""--num-seeds K: the K seeds' state stacked [K, ...] in the lead's objects (the last seed's), and functions of it
called once for all K (torch.func.vmap; random numbers drawn for all K in one call)."""

import contextlib
import traceback

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ladder.flags import UsageError, your_line
from ladder.optim import Adam


class Stacked:
    """`seeds[k]`: seed k's objects by name. Their tensors stacked at the lead's places; the others hold their rows."""

    def __init__(self, seeds: list[dict]):
        self.seeds, self.lead, self.k = seeds, seeds[-1], len(seeds)
        if [obj for obj in self.lead.values() if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, Adam)]:
            raise UsageError(
                "--num-seeds: the stacked seeds' optimizer must be ladder.optim.Adam, whose step vmap runs"
            )
        self.adams = [obj for obj in self.lead.values() if isinstance(obj, Adam)]
        self.slots, theirs = slots(self.lead), [slots(objects) for objects in seeds]
        if any([key for _, key in mine] != [key for _, key in self.slots] for mine in theirs):
            raise UsageError("--num-seeds: the seeds' agents, envs or optimizers differ in their tensors")
        with torch.no_grad():
            self.values = [torch.stack([table[key] for table, key in column]) for column in zip(*theirs)]
        self.rows = [[value[k] for value in self.values] for k in range(self.k)]
        for objects, mine, rows in zip(seeds[:-1], theirs, self.rows):
            hold(mine, rows, [obj for obj in objects.values() if isinstance(obj, Adam)])
        hold(self.slots, self.values, self.adams)
        self.theirs, self.calls, self.as_seed = theirs, {}, False

    def sync(self) -> None:
        """A stacked tensor the lead's code replaced (out of place, between calls), copied into the stack."""
        keep(self.slots, self.values)

    @contextlib.contextmanager
    def as_last_seed(self):
        """The lead's objects holding the last seed's rows alone, for what reads one seed's objects (its checkpoint,
        its evaluation, `one_by_one`)."""
        if self.as_seed:  # (an evaluation within the final checkpoint's: already so)
            yield
            return
        self.release()
        try:
            yield
        finally:
            keep(self.slots, self.rows[-1])
            hold(self.slots, self.values, self.adams)
            self.as_seed = False

    def release(self) -> None:
        """The lead's objects holding the last seed's own state alone (for good at the run's end), as the others do."""
        self.sync()
        hold(self.slots, self.rows[-1], self.adams)
        self.as_seed = True

    def share_lead(self) -> None:
        """Each seed's objects as the lead's, for its checkpoint: the rates, and the objects with no tensor (a
        scheduler: `train()` steps the lead's, for all)."""
        self.sync()
        for objects in self.seeds[:-1]:
            for name, lead in self.lead.items():
                if isinstance(lead, Adam):
                    for group, lead_group in zip(objects[name].param_groups, lead.param_groups):
                        group["lr"].copy_(lead_group["lr"])
                elif name != "envs" and not slots({name: lead}):
                    objects[name].load_state_dict(lead.state_dict())

    def one_by_one(self, fn, *args):
        """`fn(*args)` for each seed in turn, its own objects and rows in place of the lead's in `args`; the results
        stacked: what vmap cannot run (Brax's envs, which step in JAX)."""
        self.sync()
        names, outs = {id(obj): name for name, obj in self.lead.items()}, []
        leaves, spec = pytree.tree_flatten(args)
        for k, objects in enumerate(self.seeds):
            own = [objects[names[id(x)]] if id(x) in names else x[k] if torch.is_tensor(x) else x for x in leaves]
            with self.as_last_seed() if k == self.k - 1 else contextlib.nullcontext():
                outs.append(fn(*pytree.tree_unflatten(own, spec)))
            if k < self.k - 1:
                keep(self.theirs[k], self.rows[k])
        return stack(outs)

    def call(self, fn, *args):
        """`fn(*args)` for all K seeds in one vmapped call (made once for each layout of the arguments); a tensor in
        `args` must be stacked [K, ...]. What it left in the state is copied into the stack."""
        self.sync()
        leaves, spec = pytree.tree_flatten(args)
        if bad := [x for x in leaves if torch.is_tensor(x) and (x.dim() == 0 or x.shape[0] != self.k)][:1]:
            raise UsageError(
                f"--num-seeds: every tensor given to the stacked {getattr(fn, '__name__', 'call')} must be the {self.k}"
                f" seeds' own, stacked (shape [{self.k}, ...], here {tuple(bad[0].shape)}); make it with run.each(...)"
                " (docs/modifying.md#many-seeds)"
            )
        others = [repr(x) if isinstance(x, (int, float)) else id(x) for x in leaves if not torch.is_tensor(x)]
        if (layout := (id(fn), str(spec), *others)) not in self.calls:

            def on_one_seed(values, tensors):
                originals = [table[key] for table, key in self.slots]
                for (table, key), value in zip(self.slots, values):  # (a parameter too: its place, for the call)
                    table[key] = value
                swapped = [adam.swap(adam.flat) for adam in self.adams]  # its parameters: views of the seed's vector
                try:
                    tensors = iter(tensors)
                    out = fn(*pytree.tree_unflatten([next(tensors) if torch.is_tensor(x) else x for x in leaves], spec))
                    return out, [table[key] for table, key in self.slots]
                finally:
                    for adam, parameters in zip(self.adams, swapped):
                        adam.swap(parameters)
                    for (table, key), value in zip(self.slots, originals):
                        table[key] = value

            self.calls[layout] = torch.func.vmap(on_one_seed, randomness="different")
        out, state = refusing(self.calls[layout], self.values, [x for x in leaves if torch.is_tensor(x)])
        with torch.no_grad():
            for value, changed in zip(self.values, state):
                if changed is not value:
                    value.copy_(changed)
        return out

    def each(self, fn, *args):
        """`fn(*args)` for each seed, vmapped (its own random numbers, all K drawn in one call); the results stacked
        [K, ...], each in memory of its own."""
        out = self.call(fn, *args)
        return pytree.tree_map(lambda x: x.clone() if torch.is_tensor(x) and 0 in x.stride() else x, out)


def slots(objects: dict) -> list[tuple]:
    """Where the tensors of `objects` live, (table, key): modules' parameters (an Adam's flat ones instead) and
    buffers, Adams' moments, other objects' tensor attributes."""
    objects, adams = list(objects.values()), [obj for obj in objects.values() if isinstance(obj, Adam)]
    held = {id(p) for adam in adams for group in adam.param_groups for p in group["params"]}
    modules = list(dict.fromkeys(m for obj in objects if isinstance(obj, nn.Module) for m in obj.modules()))
    tables = [m._parameters for m in modules] + [m._buffers for m in modules]
    tables += [t for adam in adams for t in (vars(adam), adam.state["flat"])]
    tables += [vars(obj) for obj in objects if not isinstance(obj, (nn.Module, torch.optim.Optimizer))]
    return [(t, key) for t in tables for key, v in t.items() if torch.is_tensor(v) and id(v) not in held]


def hold(places: list, values: list, adams: list) -> None:
    """`values` at `places` (a parameter stays that object: optimizers know it), Adams' parameters views of theirs."""
    for (table, key), value in zip(places, values):
        if isinstance(table[key], nn.Parameter):
            table[key].data = value
        else:
            table[key] = value
    for adam in adams:
        adam.attach(adam.flat)


def keep(places: list, values: list) -> None:
    """What the code put at `places` in place of `values` (an env's state replaced out of place), copied into them."""
    for (table, key), value in zip(places, values):
        if table[key] is not value:
            with torch.no_grad():
                value.copy_(table[key])
            hold([(table, key)], [value], [])


def stack(outs: list):
    """The seeds' results, each a tree of the same structure: their tensors stacked, [K, ...]."""
    leaves, specs = zip(*map(pytree.tree_flatten, outs))
    return pytree.tree_unflatten([torch.stack(c) if torch.is_tensor(c[0]) else c[0] for c in zip(*leaves)], specs[0])


def refusing(call, *args):
    """`call(*args)`; what vmap cannot do (a host read, a branch on a value) ends the run in one line naming yours."""
    try:
        return call(*args)
    except RuntimeError as e:
        if not any(word in str(e) for word in ("vmap", "functorch", "batched")):
            raise
        where = your_line(traceback.extract_tb(e.__traceback__))
        raise UsageError(
            f"--num-seeds: {str(e).splitlines()[0][:160]} ({where}); see docs/modifying.md#many-seeds"
        ) from None
