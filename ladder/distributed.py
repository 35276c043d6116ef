"""torchrun: data parallel over ranks (each its own envs, one all-reduce of the gradients), kept alike."""

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before a process group exists: docs/running.md, "torchrun"
import torch.nn as nn

from ladder.flags import UsageError


def average_gradients(module: nn.Module, stats: dict | None = None) -> dict | None:
    """`module`'s gradients (between `backward()` and `step()`) and `stats` (returned) averaged over the ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return stats
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    tensors = grads + list((stats or {}).values())
    flat = torch.cat([t.detach().flatten() for t in tensors])
    dist.all_reduce(flat)  # one all-reduce for all
    means = (flat / dist.get_world_size()).split([t.numel() for t in tensors])
    for grad, mean in zip(grads, means):
        grad.copy_(mean.view_as(grad))
    return None if stats is None else {tag: mean.view_as(stats[tag]) for tag, mean in zip(stats, means[len(grads) :])}


def rank_0s(failed: Exception | None) -> Exception | None:
    """Rank 0's `failed` on every rank (a UsageError on the others: rank 0 says it), else they would train on alone."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failed
    dist.broadcast_object_list(shared := [failed], src=0)
    return failed or shared[0] and UsageError(f"rank 0: {shared[0]}")


def alike(stateful: dict, per_rank: set) -> dict:
    return {k: v for k, v in stateful.items() if k not in per_rank and (torch.is_tensor(v) or isinstance(v, nn.Module))}


def broadcast_from_rank_0(shared: dict) -> None:
    for value in shared.values():
        for tensor in [value] if torch.is_tensor(value) else value.state_dict().values():
            dist.broadcast(tensor, src=0)


def ranks_apart(shared: dict, noted: set, note) -> dict[str, torch.Tensor]:
    """At a checkpoint, the `alike` state that differs between the ranks, noted once per name (`noted`): of parameters
    rank 0's is saved; the rest (a statistic of the rank's own observations) is returned for this rank's to keep."""
    tensors, parameters = {}, set()
    for name, value in shared.items():
        if torch.is_tensor(value):
            tensors[name] = value.detach()
        else:
            parameters |= {f"{name}.{key}" for key, _ in value.named_parameters()}
            tensors |= {f"{name}.{key}": t.detach() for key, t in [*value.named_parameters(), *value.named_buffers()]}
    sums = {name: float(tensor.double().sum()) for name, tensor in tensors.items()}
    dist.all_gather_object(every := [None] * dist.get_world_size(), sums)
    apart = [name for name in sums if len({rank[name] for rank in every}) > 1]
    for owner in dict.fromkeys(n.split(".")[0] for n in apart if n in parameters and n.split(".")[0] not in noted):
        noted.add(owner)  # (by the module's name: its buffers noted before do not hide its weights)
        fix = f"average its gradients: average_gradients({owner}) between backward() and step(), docs/modifying.md"
        note(f"{owner} differs between the torchrun ranks ({fix}); rank 0's is saved")
    if own := [name for name in apart if name not in parameters and name not in noted]:
        noted.update(own)
        verb = "differs" if len(own) == 1 else "differ"
        kept = "each rank's is saved and resumed as its own (docs/modifying.md#your-own-state)"
        note(f"{', '.join(own)} {verb} between the torchrun ranks: {kept}")
    return {name: tensors[name].cpu() for name in apart if name not in parameters}


def load_ranks_own(stateful: dict, saved: dict[str, torch.Tensor]) -> None:
    for name, value in saved.items():
        owner, _, buffer = name.partition(".")
        (stateful[owner].get_buffer(buffer) if buffer else stateful[owner]).copy_(value)
