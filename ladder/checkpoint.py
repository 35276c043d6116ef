"""Checkpoints: what <run folder>/checkpoint.pt holds, how it is written (atomically) and read back by --resume."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree


def read_summary(folder: Optional[str]) -> Optional[dict]:
    """A run folder's or an aggregate folder's summary.json; None where there is none."""
    if folder is None or not os.path.isfile(path := os.path.join(folder, "summary.json")):
        return None
    with open(path) as f:
        return json.load(f)


def read_checkpoint(path: str, script: str, flag: str = "--resume") -> dict:
    """The checkpoint at `path` (or `path`/checkpoint.pt; with --load-model a model too) as plain data, on the CPU;
    one written by a script other than `script` (a file name) is refused."""
    from ladder.cli import UsageError

    file = os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path
    if not os.path.isfile(file) and os.path.isfile(os.path.join(path, "summary.json")):  # K seeds' aggregate folder:
        dirs = read_summary(path).get("run_dirs") or [file]  # the first seed's checkpoint (a run's own: none)
        saved = read_checkpoint(dirs[0], script, flag)
        return saved | {"args": saved["args"] | {"num_seeds": len(dirs)}}
    if not os.path.isfile(file):
        raise UsageError(f"{flag} {path}: no such file")
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, or holding objects other than plain data
        raise UsageError(f"{flag} {file} is not a readable checkpoint ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(saved, dict) or saved.get("script", script) != script:
        raise UsageError(f"{flag} {file} was written by {saved.get('script', 'something else')}, not {script}")
    if flag == "--resume" and "counters" not in saved:
        raise UsageError(f"--resume {file} holds weights only; evaluate them with --eval-only --load-model")
    return saved


def load_in_place(obj, saved) -> None:
    """`obj` as `saved` has it, in place: a tensor copied into, an object through its load_state_dict; an optimizer's
    param groups stay the dicts they were (torch's load_state_dict makes new ones, and a reference the code took to one
    before, to anneal its rate, would go dead)."""
    if torch.is_tensor(obj):
        obj.copy_(saved)
        return
    groups = obj.param_groups if isinstance(obj, torch.optim.Optimizer) else None
    obj.load_state_dict(saved)
    if groups is not None:
        for group, loaded in zip(groups, obj.param_groups):
            group.update(loaded)
        obj.param_groups = groups


def state(obj):
    """What a checkpoint keeps of a tensor (itself) or of an object (its state_dict)."""
    return obj if torch.is_tensor(obj) else obj.state_dict()


def save_checkpoint(run) -> None:
    """`run`'s checkpoint.pt: the state given to `run.start` and, from every torchrun rank, its RNGs and envs, with
    the counters and the recent returns; written to a temporary file, then renamed (a kill mid-write leaves the old)."""
    from ladder.distributed import ranks_apart

    cuda = torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None
    envs = run.envs.state_dict() if hasattr(run.envs, "state_dict") else None  # EnvPool's emulators: none
    # each rank's own state on the CPU: gathered under NCCL, a CUDA tensor of rank r would be rebuilt on cuda:r
    on_cpu = lambda x: x.cpu() if torch.is_tensor(x) else x
    own = {k: pytree.tree_map(on_cpu, state(v)) for k, v in run.stateful.items() if k in run.per_rank}
    ranks = [mine := {"rng": torch.get_rng_state(), "cuda_rng": cuda, "envs": envs, "state": own}]
    if run.world_size > 1:  # every rank's RNGs, envs and own state, to rank 0
        mine["apart"] = ranks_apart(run)
        dist.gather_object(mine, ranks := [None] * run.world_size if run.rank == 0 else None, dst=0)
    run.checkpointed = run.counters["iteration"]
    if run.rank != 0:
        return
    checkpoint = {k: state(v) for k, v in run.stateful.items() if k not in own} | {"ranks": ranks, "script": run.script}
    checkpoint |= dict(args=asdict(run.args), counters=run.counters, recent_returns=list(run.recent_returns))
    checkpoint["wandb_id"] = run.wandb and run.wandb.id
    path = os.path.join(run.dir, "checkpoint.pt")
    with open(path + ".tmp", "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename, so a crash cannot leave a renamed empty file
    os.replace(path + ".tmp", path)  # atomic


def restore_progress(run, saved: dict, obs):
    """--resume, once the state given to `run.start` is loaded: the counters, recent returns, this rank's RNGs and
    envs as `saved` has them; returns the envs' observation (`obs` where the envs have no state_dict)."""
    from ladder.cli import UsageError

    run.counters.update(saved["counters"])
    done = run.counters["target_reached"] and saved["args"]["target_return"] == run.args.target_return
    if done or run.counters["global_step"] >= run.total_steps:  # a finished run would only evaluate again
        raise UsageError(f"--resume {run.args.resume}: the run has ended; raise --total-timesteps or --target-return")
    run.recent_returns.extend(saved["recent_returns"])
    run.checkpointed, mine = run.counters["iteration"], saved["ranks"][run.rank]
    torch.set_rng_state(mine["rng"])
    if mine["cuda_rng"] is not None and run.device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda_rng"], run.device)
    obs = obs if mine["envs"] is None else run.envs.load_state_dict(mine["envs"])
    anew = "; the envs have no state_dict(), so their episodes start anew" if mine["envs"] is None else ""
    run.note(f"resumed {run.dir} at step {run.counters['global_step']:,}{anew}")
    return obs
