"""Adam on parameters held flat: one gradient step, alike eager, compiled, vmapped over seeds and in a CUDA graph."""

import torch
import torch.nn as nn

from ladder.flags import UsageError


class Adam(torch.optim.Optimizer):
    """Adam (AdamW's decoupled `weight_decay`) on `module`'s trainable parameters or `params`, views of one flat
    vector: `step()` reads their `.grad`, updates in ~10 ops. A rate is a device tensor, set in place (not baked in)."""

    def __init__(self, module: nn.Module, params=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        if params is None:  # the trainable ones no other Adam holds (it makes them views of its flat vector)
            params = [p for p in module.parameters() if p.requires_grad and p.untyped_storage().nbytes() == p.nbytes]
        # capturable: its step can be recorded in a CUDA graph (and torch.compile, which says so, changes no group)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=True))
        held = [p for group in self.param_groups for p in group["params"]]
        names = {id(p): name for name, p in module.named_parameters() if p.untyped_storage().nbytes() == p.nbytes}
        if len({id(p) for p in held}) < len(held) or any(id(p) not in names for p in held):
            raise ValueError("Adam takes each of the module's parameters once, none another Adam holds, and no other")
        self.module, self.calling, self.shapes = module, Calling(module), [p.shape for p in held]
        self.sizes = [sum(p.numel() for p in group["params"]) for group in self.param_groups]
        index = {id(p): i for i, p in enumerate(held)}  # each place that holds a parameter (a shared one: several)
        own = [(m, key, index.get(id(p))) for m in module.modules() for key, p in m.named_parameters(recurse=False)]
        self.places = sorted([place for place in own if place[2] is not None], key=lambda place: place[2])
        self.held = {"flat": torch.cat([p.detach().reshape(-1) for p in held])}
        self.attach(self.flat)
        for group in self.param_groups:  # a tensor: a compiled or recorded step reads it, the rate not baked in
            group["lr"] = torch.tensor(float(group["lr"]), device=self.flat.device)
        zeros = torch.zeros_like(self.flat)
        self.state["flat"] = dict(step=torch.zeros((), device=zeros.device), exp_avg=zeros, exp_avg_sq=zeros.clone())
        self._opt_called = True  # `step` takes steps: an lr scheduler's warning that it never does is wrong
        type(self).step._wrapped_by_lr_sched = True  # so a scheduler does not wrap it in a function dynamo skips

    @property
    def flat(self) -> torch.Tensor:  # in a dict: dynamo sees what a compiled --num-seeds call puts there
        return self.held["flat"]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        parts = flat.split([shape.numel() for shape in self.shapes], dim=-1)
        return [x.view(*flat.shape[:-1], *shape) for x, shape in zip(parts, self.shapes)]

    @torch.no_grad()  # (set_ on a parameter: the same object, now a view of `flat`)
    def attach(self, flat: torch.Tensor) -> None:
        self.held["flat"], views = flat, self.views(flat)
        for p, view in zip([p for group in self.param_groups for p in group["params"]], views):
            p.set_(view)

    def call_with(self, flat: torch.Tensor, fn, *args):
        """`fn(*args)` with views of `flat` in the places of the held parameters (vmapped: the seed's vector)."""
        views, names = self.views(flat), self.calling.names
        tensors = {names[id(m), key]: views[i] for m, key, i in self.places}
        return torch.func.functional_call(self.calling, tensors, (fn, *args), tie_weights=False)

    def backward(self, loss_fn, module: nn.Module, *args) -> dict:
        """`loss.backward()` of `loss, stats = loss_fn(module, *args)`, vmapped too: the held parameters' gradient added
        to their `.grad`, by torch.autograd (eager, compiled) or torch.func.grad (vmapped); returns `stats`."""
        if self.flat.dim() > 1:  # the K seeds' weights, stacked, outside the vmapped call (their shapes would not fit)
            raise UsageError("--num-seeds: call optimizer.backward(...) in a function wrapped by run.one_call(...)")
        held = list({i: getattr(m, key) for m, key, i in self.places}.values())  # (vmapped: the seed's)
        untraceable = torch.compiler.is_compiling() and not getattr(torch._dynamo.config, "trace_autograd_ops", False)
        if isinstance(held[0], nn.Parameter) and not untraceable:
            loss, stats = loss_fn(module, *args)
            grads = torch.autograd.grad(loss, held, allow_unused=True)
        else:  # vmapped (autograd cannot run there), or compiled by a torch whose dynamo cannot trace autograd.grad
            flat_grad, stats = torch.func.grad(self.call_with, has_aux=True)(self.flat, loss_fn, module, *args)
            grads = self.views(flat_grad)
        for p, g in zip(held, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        return stats

    def zero_grad(self, set_to_none: bool = True) -> None:  # torch's is one a compiled graph cannot hold
        for p in self.module.parameters():  # all the module's: a clip of them then counts no other optimizer's
            p.grad = None if set_to_none or p.grad is None else p.grad.zero_()

    def flat_grad(self) -> torch.Tensor:
        """The held parameters' `.grad` (where the module holds them: vmapped, the seed's; none: zero) as one vector."""
        held = {i: getattr(m, key) for m, key, i in self.places}.values()
        if all(p.grad is None for p in held):  # torch's optimizers would skip the step, silently: no learning
            raise UsageError("optimizer.step() found no gradient: take it with optimizer.backward(loss_fn, agent, ...)")
        return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in held])

    @torch.no_grad()
    def step(self, closure=None):
        """Adam's update of the flat vector with `flat_grad()`, each param group with its own settings."""
        loss = None if closure is None else torch.enable_grad()(closure)()
        s, split, grad = self.state["flat"], lambda x: x.split(self.sizes), self.flat_grad()
        s["step"] += 1
        groups = zip(self.param_groups, split(self.flat), split(grad), split(s["exp_avg"]), split(s["exp_avg_sq"]))
        for group, p, g, m, v in groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            if not torch.is_tensor(lr):  # CleanRL's `param_groups[0]["lr"] = lrnow`: a graph would keep the first one
                raise UsageError(f'group["lr"] = {lr!r}, a number: set the rate in place, group["lr"].fill_(...)')
            m.mul_(beta1).add_(g, alpha=1 - beta1)  # (vmap has no rule for lerp_)
            v.mul_(beta2).add_(g * g, alpha=1 - beta2)  # (vmap has no rule for addcmul_)
            if group["weight_decay"]:  # decoupled, as AdamW
                p.mul_(1 - lr * group["weight_decay"])
            denom = (v / (1 - beta2 ** s["step"])).sqrt_().add_(group["eps"])
            p.sub_(lr / (1 - beta1 ** s["step"]) * m / denom)
        return loss

    def add_param_group(self, param_group: dict) -> None:  # torch's, without importing torch._dynamo (~0.9 s)
        untraced(torch.optim.Optimizer.add_param_group)(self, param_group)

    def state_dict(self) -> dict:  # torch's too (its hooks run): {"state": {"flat": ...}, "param_groups": ...}
        return untraced(torch.optim.Optimizer.state_dict)(self)

    def _patch_step_function(self) -> None:
        """(torch.optim wraps step() in a profiler's record, which a compiled graph ignores, warning: not here.)"""

    def no_hooks(self, *args, **kwargs):
        raise UsageError("ladder.optim.Adam runs no step or load hooks (its step is compiled, vmapped): call yours")

    register_step_pre_hook = register_step_post_hook = no_hooks
    register_load_state_dict_pre_hook = register_load_state_dict_post_hook = no_hooks

    def load_state_dict(self, saved: dict) -> None:
        """The moments and step in place (`state_dict`'s or an older flat one), each group's settings (rates filled)."""
        state = saved.get("state", {}).get("flat", saved.get("state"))
        if set(state or {}) != {"step", "exp_avg", "exp_avg_sq"}:
            raise ValueError("its Adam state is per parameter: a checkpoint from before ladder's flat Adam")
        for key, value in state.items():
            self.state["flat"][key].copy_(value)
        for group, settings in zip(self.param_groups, saved["param_groups"]):
            for key, value in [(k, v) for k, v in settings.items() if k != "params"]:
                group[key] = group[key].fill_(value) if torch.is_tensor(group[key]) else value  # a rate: in place


def untraced(method):  # torch.optim's `method` without the wrapper whose first call imports torch._dynamo
    return getattr(method, "__wrapped__", method)


class Calling(nn.Module):
    """`fn(*args)` as `forward`, for torch.func.functional_call to run with other tensors in `modules`' places."""

    def __init__(self, *modules: nn.Module):
        super().__init__()
        self.all, named = nn.ModuleList(modules), self.named_modules(remove_duplicate=False)
        self.names = {(id(m), key): f"{at}.{key}" for at, m in named for key, _ in m.named_parameters(recurse=False)}

    def forward(self, fn, *args):
        return fn(*args)
