"""Adam on parameters held flat: one gradient step, alike eager, compiled, vmapped over seeds and in a CUDA graph."""

import torch
import torch.nn as nn


class Adam(torch.optim.Optimizer):
    """Adam (Kingma & Ba 2015; AdamW's decoupled `weight_decay`) on `module`'s trainable parameters or `params` (some,
    or param groups), views of one flat vector (the moments flat too): `gradient` gives one vector, `step(grad)`
    updates in ~10 ops. A group's rate is a device tensor, changed in place (`group["lr"].fill_(rate)`), not baked into
    a compiled graph."""

    def __init__(self, module: nn.Module, params=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        params = [p for p in module.parameters() if p.requires_grad] if params is None else params
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        held = [p for group in self.param_groups for p in group["params"]]
        names = {id(p): name for name, p in module.named_parameters()}
        if len({id(p) for p in held}) < len(held) or any(id(p) not in names for p in held):
            raise ValueError("Adam takes each of the module's parameters once, and no other")
        self.module, self.shapes = module, [p.shape for p in held]
        self.sizes = [sum(p.numel() for p in group["params"]) for group in self.param_groups]
        index = {id(p): i for i, p in enumerate(held)}  # each place that holds a parameter (a shared one: several)
        tables = {id(m._parameters): m._parameters for _, m in module.named_modules(remove_duplicate=False)}.values()
        self.places = [(t, key, index[id(p)]) for t in tables for key, p in t.items() if id(p) in index]
        with torch.no_grad():
            self.held = {"flat": torch.cat([p.reshape(-1) for p in held])}
        self.attach(self.flat)
        for p in held:  # a backward() through them would fill .grad, which no step reads: it fails instead
            p.requires_grad_(False)
        for group in self.param_groups:  # a tensor: a compiled or recorded step reads it, the rate not baked in
            group["lr"] = torch.tensor(float(group["lr"]), device=self.flat.device)
        zeros = torch.zeros_like(self.flat)
        self.state["flat"] = dict(step=torch.zeros((), device=zeros.device), exp_avg=zeros, exp_avg_sq=zeros.clone())
        self._opt_called = True  # `step` takes steps: an lr scheduler's warning that it never does is wrong

    @property
    def flat(self) -> torch.Tensor:  # in a dict: dynamo sees what a compiled --num-seeds call puts there
        return self.held["flat"]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each held parameter as a view of `flat` (of this layout: a gradient too; [K, ...]: K stacked seeds')."""
        parts = flat.split([shape.numel() for shape in self.shapes], dim=-1)
        return [x.view(*flat.shape[:-1], *shape) for x, shape in zip(parts, self.shapes)]

    def attach(self, flat: torch.Tensor) -> None:
        """The flat vector `flat` (the stacked seeds': [K, ...]), the module's parameters views of it."""
        self.held["flat"], views, self.vmapped = flat, self.views(flat), flat.dim() > 1  # K seeds': used in vmap
        for table, key, i in self.places:
            table[key].data = views[i]

    def swap(self, values):
        """Views of flat `values` (or the list this returned) where the module holds its parameters; returns those."""
        if torch.is_tensor(values):
            views = self.views(values)
            values = [views[i] for _, _, i in self.places]
        previous = [table[key] for table, key, _ in self.places]
        for (table, key, _), value in zip(self.places, values):
            table[key] = value
        return previous

    def gradient(self, loss_fn, module: nn.Module, *args):
        """(the flat gradient of the loss, the statistics) of `loss_fn(module, *args)` -> (loss, statistics): by
        torch.autograd eager and compiled, by torch.func.grad vmapped (--num-seeds; autograd cannot run there)."""
        assert module is self.module, "the gradient is in the parameters of the module the optimizer was built on"

        def loss_in(flat):
            held = self.swap(flat)
            try:
                return loss_fn(module, *args)
            finally:
                self.swap(held)

        untraceable = torch.compiler.is_compiling() and not getattr(torch._dynamo.config, "trace_autograd_ops", False)
        if self.vmapped or untraceable:  # (an older torch's dynamo cannot trace torch.autograd.grad)
            return torch.func.grad(loss_in, has_aux=True)(self.flat)
        flat = self.flat.detach().requires_grad_()
        loss, aux = loss_in(flat)
        return torch.autograd.grad(loss, flat)[0], aux

    def step(self, grad: torch.Tensor) -> None:
        """Adam's update of the flat vector with `grad`, each param group with its own rate, betas, eps and decay."""
        s, split = self.state["flat"], lambda x: x.split(self.sizes)
        s["step"] += 1
        groups = zip(self.param_groups, split(self.flat), split(grad), split(s["exp_avg"]), split(s["exp_avg_sq"]))
        for group, p, g, m, v in groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            m.mul_(beta1).add_(g, alpha=1 - beta1)  # (vmap has no rule for lerp_)
            v.mul_(beta2).add_(g * g, alpha=1 - beta2)  # (vmap has no rule for addcmul_)
            if group["weight_decay"]:  # decoupled, as AdamW
                p.mul_(1 - lr * group["weight_decay"])
            denom = (v / (1 - beta2 ** s["step"])).sqrt_().add_(group["eps"])
            p.sub_(lr / (1 - beta1 ** s["step"]) * m / denom)

    def add_param_group(self, param_group: dict) -> None:  # torch's, without importing torch._dynamo (~0.9 s)
        add = torch.optim.Optimizer.add_param_group
        getattr(add, "__wrapped__", add)(self, param_group)

    def _patch_step_function(self) -> None:
        """(torch.optim wraps step() in a profiler's record, which a compiled graph ignores, warning: not here.)"""

    def state_dict(self) -> dict:
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        return {"state": {k: v.clone() for k, v in self.state["flat"].items()}, "param_groups": groups}

    def load_state_dict(self, saved: dict) -> None:
        """The moments and step in place, each param group's settings (the rate filled in, not replaced)."""
        if set(saved.get("state", {})) != {"step", "exp_avg", "exp_avg_sq"}:
            raise ValueError("its Adam state is per parameter: a checkpoint from before ladder's flat Adam")
        for key, value in saved["state"].items():
            self.state["flat"][key].copy_(value)
        for group, settings in zip(self.param_groups, saved["param_groups"]):
            for key, value in settings.items():
                group[key].fill_(value) if torch.is_tensor(group[key]) else group.__setitem__(key, value)
