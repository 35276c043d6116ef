"""--compile: each phase of an iteration one graph, and the gradient step as one pure function (Adam written out),
which torch.compile holds in one graph and torch.func.vmap stacks over seeds (--num-seeds)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from ladder.cli import UsageError


class LossModule(nn.Module):
    """`loss_fn(agent, args, minibatch)` as a module whose parameters torch.func.functional_call swaps: the loss gets
    the real Agent compiled too."""

    def __init__(self, agent: nn.Module, loss_fn, args):
        super().__init__()
        self.agent, self.loss_fn, self.args = agent, loss_fn, args

    def forward(self, minibatch):
        return self.loss_fn(self.agent, self.args, minibatch)


def functional_gradient_step(agent: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, args):
    """The script's `gradient_step` as one pure function of (lr, batch, idx) that torch.compile makes a single graph
    (it cuts `backward()` and `step()` apart: 3x slower here) and torch.func.vmap stacks over seeds: torch.func.grad's
    gradients, clipped to `args.max_grad_norm`, in plain Adam's update written out on the optimizer's own state and
    settings (built after `run.start` has loaded them). The parameters and state are read at each call: the stacked
    seeds swap in theirs."""
    group, loss_module = optimizer.param_groups[0], LossModule(agent, loss_fn, args)
    (beta1, beta2), eps = group["betas"], group["eps"]
    for p in loss_module.parameters():
        if not optimizer.state[p]:  # what torch.optim.Adam creates at its first step
            state = dict(
                step=torch.zeros((), device=p.device), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
            )
            optimizer.state[p].update(state)
    states = [optimizer.state[p] for p in loss_module.parameters()]

    def step(lr, batch, idx=None):
        minibatch = batch if idx is None else type(batch)(*(x[idx] for x in batch))  # gathered inside the graph
        params = dict(loss_module.named_parameters())
        loss = lambda p, mb: torch.func.functional_call(loss_module, p, (mb,))
        grads, stats = torch.func.grad(loss, has_aux=True)(params, minibatch)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        clip = (args.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for p, g, s in zip(params.values(), grads.values(), states):  # s: the optimizer's state as it is now
                g = g * clip
                s["step"] += 1
                s["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)  # m = β1 m + (1 - β1) g (vmap has no lerp_ rule)
                s["exp_avg_sq"].mul_(beta2).add_(g * g, alpha=1 - beta2)  # v = β2 v + (1 - β2) g²
                denom = (s["exp_avg_sq"] / (1 - beta2 ** s["step"])).sqrt() + eps
                p.sub_(lr / (1 - beta1 ** s["step"]) * s["exp_avg"] / denom)
        return stats

    return step


def takes_functional_step(agent: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether `functional_gradient_step` can take the step: plain Adam in one param group (what it writes out), no
    parameter in two places (torch.func.grad cannot, compiled) and one process (it does not all-reduce)."""
    group, uses = optimizer.param_groups[0], len(list(agent.named_parameters(remove_duplicate=False)))
    plain = len(optimizer.param_groups) == 1 and not any(group.get(k) for k in ("weight_decay", "amsgrad", "maximize"))
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    return type(optimizer) is torch.optim.Adam and plain and uses == len(list(agent.parameters())) and alone


def compile_phases(step: functools.partial, *phases):
    """--compile: `phases` (functions of tensors) each compiled into one graph, and `step`, the script's
    `functools.partial(gradient_step, agent, optimizer, loss_fn, args)`, as `functional_gradient_step` compiled (an
    optimizer it does not write out: the loss compiled, then the optimizer's own step()). --num-seeds: the phases as
    written and the step written out (vmap cannot run backward()), uncompiled: the stacked call is compiled whole."""
    from ladder.seeds import Seeds

    gradient_step, (agent, optimizer, loss_fn, args) = step.func, step.args
    stacked = Seeds.current is not None
    if stacked and not takes_functional_step(agent, optimizer):
        name = type(optimizer).__name__  # what functional_gradient_step writes out, vmap being unable to run backward()
        raise UsageError(
            f"--num-seeds: the stacked seeds take plain Adam's step (one param group, no weight decay), not {name}'s "
            "as set here; see docs/modifying.md#many-seeds"
        )
    if args.compile:  # random ops (dropout) draw as eager ones do: the same numbers
        torch._inductor.config.fallback_random = True
    if not takes_functional_step(agent, optimizer):  # the loss's forward and backward compiled, then the optimizer's
        return *map(compiled, phases), functools.partial(gradient_step, agent, optimizer, compiled(loss_fn), args)
    build = compiled if args.compile and not stacked else lambda fn: fn
    functional = build(functional_gradient_step(agent, optimizer, loss_fn, args))
    device = next(agent.parameters()).device
    group = optimizer.param_groups[0]  # (the dict: dynamo, seeing the optimizer in a graph, would set it capturable)

    def functional_step(*batch_idx):  # the rate as the param group has it now (--resume replaced the groups before),
        lr = group["lr"]  # in a tensor: as a float it would be a constant, compiled again at every iteration
        return functional(lr if torch.is_tensor(lr) else torch.tensor(lr, device=device), *batch_idx)

    return *map(build, phases), functional_step


def compiled(fn):
    """torch.compile'd `fn` as one graph (fullgraph: a break is an error, not a silent slowdown); what stops it ends
    the run in one line (a host read, a branch on a tensor's value, a value changing at every call)."""
    graph = torch.compile(fn, fullgraph=True)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
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
