"""--num-seeds K: the K seeds' state stacked [K, ...] in the lead's objects (the last seed's), and functions of it
called once for all K (torch.func.vmap; random numbers drawn for all K in one call)."""

import contextlib
import functools
import traceback

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ladder.flags import UsageError, your_line
from ladder.optim import Adam, Calling


class Stacked:
    """`seeds[k]`: seed k's objects by name. Their tensors stacked at the lead's places; the others hold their rows.
    `flags[k]`: its flags (`swept`: the float flags that differ, which the lead's flags hold in a call as tensors)."""

    def __init__(self, seeds: list[dict], flags: list = (), swept: list[str] = ()):
        self.seeds, self.lead, self.k, self.flags, self.swept = seeds, seeds[-1], len(seeds), flags, swept
        if [obj for obj in self.lead.values() if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, Adam)]:
            raise UsageError("--num-seeds: the seeds' optimizer must be ladder.optim.Adam, whose step vmap runs")
        self.adams = [obj for obj in self.lead.values() if isinstance(obj, Adam)]
        self.root = Calling(*[obj for obj in self.lead.values() if isinstance(obj, nn.Module)])
        self.slots, theirs = slots(self.lead, bool(swept)), [slots(objects, bool(swept)) for objects in seeds]
        self.names = [self.root.names.get((id(table), key)) for table, key in self.slots]  # a parameter's, or None
        if any([key for _, key in mine] != [key for _, key in self.slots] for mine in theirs):
            raise UsageError("--num-seeds: the seeds' agents, envs or optimizers differ in their tensors")
        with torch.no_grad():
            self.values = [torch.stack([value_at(place) for place in column]) for column in zip(*theirs)]
        self.rows = [[value[k] for value in self.values] for k in range(self.k)]
        for objects, mine, rows in zip(seeds[:-1], theirs, self.rows):
            place_values(mine, rows, [obj for obj in objects.values() if isinstance(obj, Adam)])
        place_values(self.slots, self.values, self.adams)
        self.theirs, self.calls, self.as_seed = theirs, {}, False
        device = self.values[0].device
        self.hyper = [torch.tensor([getattr(f, name) for f in flags], device=device) for name in swept]

    def sync(self) -> None:
        """A stacked tensor the lead's code replaced (out of place, between calls), copied into the stack."""
        copy_replaced(self.slots, self.values)

    @contextlib.contextmanager
    def as_last_seed(self):
        """The lead's objects holding the last seed's rows alone (for its checkpoint, evaluation, `one_by_one`)."""
        if self.as_seed:  # (an evaluation within the final checkpoint's: already so)
            yield
            return
        self.release()
        try:
            yield
        finally:
            copy_replaced(self.slots, self.rows[-1])
            place_values(self.slots, self.values, self.adams)
            self.as_seed = False

    def release(self) -> None:
        """The lead's objects holding the last seed's own state alone (for good at the run's end), as the others do."""
        self.sync()
        place_values(self.slots, self.rows[-1], self.adams)
        self.as_seed = True

    def share_lead(self) -> None:
        """Each seed's objects as the lead's, for its checkpoint: the rates, objects with no tensor (a scheduler)."""
        self.sync()
        for objects in self.seeds[:-1]:
            for name, lead in self.lead.items():
                if isinstance(lead, Adam) and not self.swept:  # the rates: the lead's, which the stacked call reads
                    for group, lead_group in zip(objects[name].param_groups, lead.param_groups):
                        group["lr"].copy_(lead_group["lr"])
                elif name != "envs" and not slots({name: lead}):
                    objects[name].load_state_dict(lead.state_dict())

    def one_by_one(self, fn, *args):
        """`fn(*args)` for each seed in turn on its objects and rows (what vmap cannot run: Brax's envs), stacked."""
        self.sync()
        names, outs = {id(obj): name for name, obj in self.lead.items()}, []
        leaves, spec = pytree.tree_flatten(args)
        for k, objects in enumerate(self.seeds):
            own = [objects[names[id(x)]] if id(x) in names else x[k] if torch.is_tensor(x) else x for x in leaves]
            kept = put_flags(self.flags, self.swept, [getattr(self.flags[k], name) for name in self.swept])
            try:
                with self.as_last_seed() if k == self.k - 1 else contextlib.nullcontext():
                    outs.append(fn(*pytree.tree_unflatten(own, spec)))
            finally:
                put_flags(self.flags, self.swept, kept)
            if k < self.k - 1:
                copy_replaced(self.theirs[k], self.rows[k])
        flat, specs = zip(*map(pytree.tree_flatten, outs))  # the K seeds' results stacked
        return pytree.tree_unflatten([torch.stack(c) if torch.is_tensor(c[0]) else c[0] for c in zip(*flat)], specs[0])

    def call(self, fn, *args, compile: bool = False):
        """`fn(*args)` for all K seeds in one vmapped call, made once per layout of `args` (tensors [K, ...]; `compile`:
        one graph), the state it left copied into the stack; the results contiguous (compiled: once per layout)."""
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
            kept = [(torch.is_tensor(x), None if torch.is_tensor(x) else x) for x in leaves]  # (compiled: guarded)

            def on_one_seed(values, tensors, hyper):
                own = [(place, value) for place, value, name in zip(self.slots, values, self.names) if name is None]
                originals = [value_at(place) for place, _ in own]
                for place, value in own:
                    place_value(place, value)
                flags = put_flags(self.flags, self.swept, hyper)  # the run's own, as tensors
                tensors = iter(tensors)
                args = pytree.tree_unflatten([next(tensors) if is_tensor else x for is_tensor, x in kept], spec)

                def call():  # (vmap returns tensors: a function that returns nothing, {})
                    out = fn(*args)
                    return {} if out is None else out, [value_at(place) for place in self.slots]

                for adam in self.adams:  # its parameters: views of the seed's vector
                    call = functools.partial(adam.call_with, adam.flat, call)
                parameters = {n: x for n, x in zip(self.names, values) if n}  # by functional_call: setattr refuses them
                try:
                    return torch.func.functional_call(self.root, parameters, (call,), tie_weights=False)
                finally:  # (functional_call puts the parameters back itself)
                    for (place, _), value in zip(own, originals):
                        place_value(place, value)
                    put_flags(self.flags, self.swept, flags)

            vmapped = torch.func.vmap(on_one_seed, randomness="different")
            self.calls[layout] = torch.compile(vmapped, fullgraph=True) if compile else vmapped
        tensors = [x for x in leaves if torch.is_tensor(x)]
        out, state = refusing(self.calls[layout], self.swept, self.values, tensors, self.hyper)
        with torch.no_grad():
            for value, changed in zip(self.values, state):
                if changed is not value:
                    value.copy_(changed)
        return pytree.tree_map(lambda x: x.contiguous() if torch.is_tensor(x) else x, out)


def put_flags(flags: list, names: list[str], values: list) -> list:
    """The lead's flags (the last run's, which train() reads) holding `values` for `names`; returns their old values."""
    kept = [getattr(flags[-1], name) for name in names]
    for name, value in zip(names, values):  # (no names: no flags)
        object.__setattr__(flags[-1], name, value)  # frozen: set as its dataclass __init__ sets fields
    return kept


def slots(objects: dict, rates: bool = False) -> list[tuple]:
    """Where the tensors of `objects` live, (table, key): modules' buffers and other objects' attributes (the object
    their table: dynamo sees only what is set on it), modules' parameters (an Adam's flat ones instead), its moments,
    with `rates` its param groups' tensors (a --sweep's runs' own; else the lead's, one for all, as schedulers set)."""
    objects, adams = list(objects.values()), [obj for obj in objects.values() if isinstance(obj, Adam)]
    held = {id(p) for adam in adams for group in adam.param_groups for p in group["params"]}
    modules = list(dict.fromkeys(m for obj in objects if isinstance(obj, nn.Module) for m in obj.modules()))
    tables = [t for adam in adams for t in (adam.held, adam.state["flat"], *(adam.param_groups if rates else []))]
    tables += [obj for obj in objects if not isinstance(obj, (nn.Module, torch.optim.Optimizer))]
    items = lambda t: t.items() if isinstance(t, dict) else vars(t).items()
    tensors = lambda m: [*m.named_buffers(recurse=False), *m.named_parameters(recurse=False)]
    own = [(m, key) for m in modules for key, v in tensors(m) if id(v) not in held]
    return own + [(t, key) for t in tables for key, v in items(t) if torch.is_tensor(v)]


def value_at(place):
    return place[0][place[1]] if isinstance(place[0], dict) else getattr(*place)


def place_value(place, value) -> None:
    if isinstance(place[0], dict):
        place[0][place[1]] = value
    else:
        setattr(*place, value)


@torch.no_grad()
def place_values(places: list, values: list, adams: list) -> None:
    """`values` at `places` (a parameter stays that object: optimizers know it), Adams' parameters views of theirs."""
    for place, value in zip(places, values):
        if isinstance(value_at(place), nn.Parameter):
            value_at(place).set_(value)
        else:
            place_value(place, value)
    for adam in adams:
        adam.attach(adam.flat)


def copy_replaced(places: list, values: list) -> None:
    """What the code put at `places` in place of `values` (an env's state replaced out of place), copied into them."""
    for place, value in zip(places, values):
        if value_at(place) is not value:
            with torch.no_grad():
                value.copy_(value_at(place))
            place_values([place], [value], [])


def refusing(call, swept: list[str], *args):
    """`call(*args)`; what vmap cannot do (a host read, a branch on a value) ends the run in one line naming yours."""
    try:
        return call(*args)
    except RuntimeError as e:  # (dynamo's errors are RuntimeErrors too: Run words those, as --compile's)
        vmapped = any(word in str(e) for word in ("vmap", "functorch", "batched"))
        if not vmapped or isinstance(e, torch._dynamo.exc.TorchDynamoException):
            raise
        where, cause = your_line(traceback.extract_tb(e.__traceback__)), str(e).splitlines()[0].split(". ")[0][:160]
        if "backward() called inside a functorch transform" in cause:  # CleanRL's update
            cause = "loss.backward() cannot run vmapped: take the gradient with optimizer.backward(loss_fn, agent, ...)"
        if swept and ("data-dependent control flow" in cause or ".item()" in cause):
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in swept)
            why = "a flag Python reads as a number cannot be swept"
            raise UsageError(f"--sweep {flags}: {cause} ({where}): {why}") from None
        raise UsageError(f"--num-seeds: {cause} ({where}); see docs/modifying.md#many-seeds") from None
