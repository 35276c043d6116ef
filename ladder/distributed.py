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


def ranks_apart(run) -> dict[str, torch.Tensor]:
    """At a checkpoint: the state given to `run.start` that differs between the ranks, by name (`kl_coef`, a module's
    `agent.obs_rms.mean`), noted once for each module or tensor. Parameters: rank 0's is saved (what trains besides the
    agent stays alike only if its gradients are averaged). The rest (a statistic of the rank's own observations): this
    rank's, returned for its checkpoint to keep and a resume to give back (`load_ranks_own`)."""
    tensors, parameters = {}, set()
    for name, value in shared_state(run).items():
        if torch.is_tensor(value):
            tensors[name] = value.detach()
        else:
            parameters |= {f"{name}.{key}" for key, _ in value.named_parameters()}
            tensors |= {f"{name}.{key}": t.detach() for key, t in [*value.named_parameters(), *value.named_buffers()]}
    sums = {name: float(tensor.double().sum()) for name, tensor in tensors.items()}
    dist.all_gather_object(every := [None] * run.world_size, sums)
    apart = [name for name in sums if len({rank[name] for rank in every}) > 1]
    for owner in dict.fromkeys(name.split(".")[0] for name in apart if name.split(".")[0] not in run.diverged):
        run.diverged.add(owner)
        own = [name for name in apart if name.split(".")[0] == owner]
        if parameters.intersection(own):
            fix = f"average its gradients: average_gradients({owner}) between backward() and step(), docs/modifying.md"
            run.note(f"{owner} differs between the torchrun ranks ({fix}); rank 0's is saved")
        else:
            verb = "differs" if len(own) == 1 else "differ"
            run.note(
                f"{', '.join(own)} {verb} between the torchrun ranks: each rank's is saved and resumed as its own "
                "(docs/modifying.md#your-own-state)"
            )
    return {name: tensors[name].cpu() for name in apart if name not in parameters}


def load_ranks_own(run, saved: dict[str, torch.Tensor]) -> None:
    """This rank's own state as `ranks_apart` found it at the checkpoint, in place of rank 0's."""
    for name, value in saved.items():
        owner, _, buffer = name.partition(".")
        (run.stateful[owner].get_buffer(buffer) if buffer else run.stateful[owner]).copy_(value)
