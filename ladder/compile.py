"""--compile: each phase of an iteration one graph, and the gradient step as one pure function (Adam written out),
which torch.compile holds in one graph and torch.func.vmap stacks over seeds (--num-seeds)."""

from __future__ import annotations

import functools
import os
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn

from ladder.cli import UsageError

ADAM = torch.optim.Adam  # the class it writes out (taken at import: a test may replace torch.optim.Adam's name)


class LossModule(nn.Module):
    """`loss_fn(agent, args, minibatch)` as a module whose parameters torch.func.functional_call swaps: the loss gets
    the real Agent compiled too."""

    def __init__(self, agent: nn.Module, loss_fn, args):
        super().__init__()
        self.agent, self.loss_fn, self.args = agent, loss_fn, args

    def forward(self, minibatch):
        return self.loss_fn(self.agent, self.args, minibatch)


def functional_gradient_step(agent: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, args):
    """The script's `gradient_step` as one pure function of (the groups' rates, batch, idx) that torch.compile makes a
    single graph (it cuts `backward()` and `step()` apart: 3x slower here) and torch.func.vmap stacks over seeds:
    torch.func.grad's gradients of the optimizer's parameters (the agent's others held fixed), clipped to
    `args.max_grad_norm`, in Adam's update written out per param group, on the optimizer's own state and settings
    (built after `run.start` has loaded them). A parameter whose gradient is exactly zero takes no step: one the loss
    does not use gets zeros from torch.func.grad where backward() leaves its .grad None, which torch.optim skips. The
    parameters and state are read at each call: the stacked seeds swap in theirs."""
    loss_module = LossModule(agent, loss_fn, args)
    name_of = {p: name for name, p in loss_module.named_parameters()}
    groups = [([name_of[p] for p in g["params"]], *g["betas"], g["eps"]) for g in optimizer.param_groups]
    for p in (p for g in optimizer.param_groups for p in g["params"] if not optimizer.state[p]):
        zeros = dict(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))  # as torch.optim.Adam's first step
        optimizer.state[p].update(step=torch.zeros((), device=p.device), **zeros)
    states = {name_of[p]: optimizer.state[p] for g in optimizer.param_groups for p in g["params"]}

    def step(lrs, batch, idx=None):
        minibatch = batch if idx is None else type(batch)(*(x[idx] for x in batch))  # gathered inside the graph
        params = dict(loss_module.named_parameters())
        trained = {name: params[name] for name in states}
        loss = lambda trained, mb: torch.func.functional_call(loss_module, params | trained, (mb,))
        grads, stats = torch.func.grad(loss, has_aux=True)(trained, minibatch)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        clip = (args.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for lr, (names, beta1, beta2, eps) in zip(lrs, groups):
                for name in names:  # s: the optimizer's state as it is now
                    p, g, s = params[name], grads[name] * clip, states[name]
                    used = (g != 0).any()
                    s["step"] += used  # m = β1 m + (1 - β1) g, v = β2 v + (1 - β2) g² (vmap has no lerp_ rule)
                    m = torch.where(used, s["exp_avg"].mul(beta1).add_(g, alpha=1 - beta1), s["exp_avg"])
                    v = torch.where(used, s["exp_avg_sq"].mul(beta2).add_(g * g, alpha=1 - beta2), s["exp_avg_sq"])
                    s["exp_avg"].copy_(m)
                    s["exp_avg_sq"].copy_(v)
                    denom = (v / (1 - beta2 ** s["step"])).sqrt() + eps
                    p.sub_(torch.where(used, lr / (1 - beta1 ** s["step"]) * m / denom, 0.0))
        return stats

    return step


def cannot_take_functional_step(agent: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """Why `functional_gradient_step` cannot take the optimizer's step ("": it can). It writes out Adam, plain in each
    param group, on the parameters the optimizer holds: those must be the agent's trainable ones (another optimizer's
    would go unstepped), none in two places (torch.func.grad cannot, compiled), in one process (no all-reduce)."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    trainable = [p for p in agent.parameters() if p.requires_grad]
    decays = [k for g in optimizer.param_groups for k in ("weight_decay", "amsgrad", "maximize") if g.get(k)]
    if type(optimizer) is not ADAM or decays:
        return f"{type(optimizer).__name__}{f' with {decays[0]}' if decays else ''}, not plain Adam"
    if {id(p) for p in held} != {id(p) for p in trainable} or len(held) != len(trainable):
        return "the optimizer holds other parameters than the agent's trainable ones (another optimizer's?)"
    if len(list(agent.named_parameters(remove_duplicate=False))) != len(list(agent.parameters())):
        return "a parameter of the agent is in two places"
    if dist.is_initialized() and dist.get_world_size() > 1:
        return "under torchrun the gradients are all-reduced"
    return ""


def compile_phases(step: functools.partial, *phases):
    """--compile: `phases` (functions of tensors) each compiled into one graph, and `step`, the script's
    `functools.partial(gradient_step, agent, optimizer, loss_fn, args)`, as `functional_gradient_step` compiled (where
    it cannot take the optimizer's step: the loss compiled, then the script's `gradient_step` with the optimizer's own
    step()). --num-seeds: the phases as written and the step written out (vmap cannot run backward()), uncompiled:
    the stacked call is compiled whole."""
    from ladder.seeds import Seeds

    gradient_step, (agent, optimizer, loss_fn, args) = step.func, step.args
    stacked, why_not = Seeds.current is not None, cannot_take_functional_step(agent, optimizer)
    if stacked and why_not:  # vmap cannot run backward()
        raise UsageError(
            f"--num-seeds: the stacked seeds take Adam's step written out, plain in each param group, on the agent's "
            f"parameters; here: {why_not}; see docs/modifying.md#many-seeds"
        )
    if args.compile:  # random ops (dropout) draw as eager ones do: the same numbers
        torch._inductor.config.fallback_random = True
    if why_not:  # the loss's forward and backward compiled, then the script's step
        return *map(compiled, phases), functools.partial(gradient_step, agent, optimizer, compiled(loss_fn), args)
    build = compiled if args.compile and not stacked else lambda fn: fn
    functional = build(functional_gradient_step(agent, optimizer, loss_fn, args))
    device = next(agent.parameters()).device
    groups = optimizer.param_groups  # (the dicts: dynamo, seeing the optimizer in a graph, would set it capturable)
    optimizer._opt_called = True  # its steps are taken: an lr_scheduler's warning that step() is never called is wrong

    def functional_step(*batch_idx):  # the rates as the param groups have them now, in tensors: as floats they would
        lrs = [group["lr"] for group in groups]  # be constants, compiled again at every iteration
        return functional([lr if torch.is_tensor(lr) else torch.tensor(lr, device=device) for lr in lrs], *batch_idx)

    return *map(build, phases), functional_step


def compiled(fn):
    """torch.compile'd `fn` as one graph (fullgraph: a break is an error, not a silent slowdown); what stops it ends
    the run in one line (a host read, a branch on a tensor's value, a value changing at every call)."""
    # a recurrence unrolled over T steps (an env's state through sin, clamp, where) is inlined into each step's
    # kernels up to a number of ops, 50 on a CPU by inductor's default, 30 on a GPU: at 50 a continuous Pendulum's
    # rollout took 435 s to compile at T=12, at 30 59 s (benchmarks/compile_time.py)
    graph = torch.compile(fn, fullgraph=True, options={"realize_cpu_opcount_threshold": 30})

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            # while dynamo compiles: torch 2.13 takes a 0-dim float64 CPU tensor (a running count) for a Python float,
            # and its "tensorify" pass drops an in-place update of it (test_compile.py: ..._float64_scalars_update)
            with mock.patch.dict(os.environ, TENSORIFY_PYTHON_SCALARS="0"):
                return graph(*args, **kwargs)
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            cause, where = lines[0], [f" ({line})" for line in lines if line.startswith("File ")][-1:]  # your line
            if isinstance(e, torch._dynamo.exc.FailOnRecompileLimitHit):  # dynamo's last reason: the guard that failed
                reasons = max(torch._dynamo.utils.guard_failures.values(), key=len, default=[])
                guard = " ".join(reasons[-1].split("User stack trace")[0].split()) if reasons else "a value changed"
                cause = f"it compiles again at every call, as {guard}"
            raise UsageError(f"--compile: {cause}{''.join(where)}; see docs/modifying.md#compiled-graphs") from None

    return call
