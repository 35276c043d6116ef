"""torchrun: data parallel over ranks (each its own envs, one all-reduce of the gradients), and what keeps them
alike."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before a process group exists: docs/running.md, "torchrun"
import torch.nn as nn


def average_gradients(module: nn.Module) -> None:
    """Under torchrun each gradient of `module` becomes the ranks' mean, in one all-reduce (in one process: nothing).
    Call it between `backward()` and `step()` for a network you train besides the agent, or its ranks drift apart."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    for grad, mean in zip(grads, mean_over_ranks(grads)):
        grad.copy_(mean)  # in one process the same tensor: a no-op


def mean_over_ranks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's mean over the torchrun ranks, all in one all-reduce (the tensors themselves in one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensors
    flat = torch.cat([t.detach().flatten() for t in tensors])
    dist.all_reduce(flat)
    means = (flat / dist.get_world_size()).split([t.numel() for t in tensors])
    return [mean.view_as(t) for t, mean in zip(tensors, means)]


def shared_state(run) -> dict:
    """What the torchrun ranks hold alike, by name: the modules (the agent, yours) and tensors given to `run.start`,
    but those given as `PerRank`."""
    alike = {k: v for k, v in run.stateful.items() if k not in run.per_rank}
    return {k: v for k, v in alike.items() if torch.is_tensor(v) or isinstance(v, nn.Module)}


def broadcast_from_rank_0(run) -> None:
    """Every rank starts from rank 0's weights, statistics and state given to `run.start`."""
    for value in shared_state(run).values():
        for tensor in [value] if torch.is_tensor(value) else value.state_dict().values():
            dist.broadcast(tensor, src=0)


def note_ranks_apart(run) -> None:
    """At a checkpoint: a note for each module or tensor that differs between the ranks (rank 0's is saved), once.
    What trains besides the agent stays alike on every rank only if its gradients are averaged."""
    sums = {}
    for name, value in shared_state(run).items():
        tensors = [value] if torch.is_tensor(value) else value.parameters()
        sums[name] = float(sum(t.detach().double().sum() for t in tensors))
    dist.all_gather_object(every := [None] * run.world_size, sums)
    for name in [k for k in sums if len({rank[k] for rank in every}) > 1 and k not in run.diverged]:
        run.diverged.add(name)
        if isinstance(run.stateful[name], nn.Module) and any(True for _ in run.stateful[name].parameters()):
            fix = f"average its gradients: average_gradients({name}) between backward() and step()"
        else:  # a tensor or buffers: no gradient to average
            fix = f"if each rank keeps its own, give it to run.start as PerRank({name})"
        run.note(f"{name} differs between the torchrun ranks ({fix}, docs/modifying.md); rank 0's is saved")
