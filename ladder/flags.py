"""The run's flags, which every script's `Args` inherits, and the one-line error a wrong flag ends in."""

import math
import os
import sys
from dataclasses import dataclass, fields, replace
from typing import Annotated, Optional

import torch
import tyro


class UsageError(Exception):
    """A bad flag, a wrong combination of flags or a missing package: one `error: ...` line, exit code 2."""


@dataclass(frozen=True)  # the run's flags, fixed: what changes in training is a tensor (docs/modifying.md)
class RunFlags:
    """The run's length and its management. A script's `Args` adds the algorithm's flags, which a --resume keeps as
    the checkpoint has them; these it may change. A script overrides a default by declaring the field again."""

    total_timesteps: int = 5_000_000
    """env steps to train, all torchrun ranks together, in whole rollouts (may stop earlier: `target-return`)"""
    target_return: Optional[float] = None
    """stop once the mean return of the last 100 episodes reaches this (None: never)"""
    exp_name: str = "experiment"
    """the name of this experiment (part of the run folder's name)"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """torch device to run everything on (cuda when available, else cpu)"""
    torch_threads: int = 0
    """CPU threads for torch (ignored on GPU); 0: one per core, or one where the script's nets are too small to share"""
    compile: bool = False
    """torch.compile the iteration's phases (VPG: the whole iteration; iteration 1 compiles: not counted in SPS)"""
    cuda_graph: bool = True
    """on a GPU, record an iteration once as a CUDA graph and replay it (--no-cuda-graph: the loop as written)"""
    num_seeds: int = 1
    """train seeds `seed` .. `seed`+K-1 in this process, their work stacked (vmap): a run folder each, an aggregate"""
    sweep: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """NAME=V1,V2,...: a run per value of an algorithm's float flag (several: their grid), stacked (docs/running.md)"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "rl-ladder"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team); None uses your default"""
    wandb_group: Optional[str] = None
    """the W&B group of the run (--num-seeds: each seed's run in the group of their aggregate folder's name)"""
    capture_video: bool = False
    """film the policy every `video-interval` iterations and in the final evaluation (videos/ in the run folder)"""
    video_interval: int = 25
    """iterations between two videos, the first at iteration 1 (0: no videos during training)"""
    save_model: bool = False
    """save the agent's weights to the run folder at the end (also on Ctrl-C)"""
    checkpoint_interval: int = 1000
    """iterations between checkpoints to <run folder>/checkpoint.pt (0: only at the end, on Ctrl-C or SIGTERM)"""
    resume: Optional[str] = None
    """a run folder (or its checkpoint.pt) to go on from: omitted flags keep its values; only these run flags change"""
    eval_only: bool = False
    """no training: play `eval-episodes` episodes with the `load-model` weights (filmed with --capture-video)"""
    load_model: Optional[str] = None
    """the weights for --eval-only: a saved .cleanrl_model or a checkpoint.pt"""
    eval_episodes: int = 10
    """episodes the greedy policy plays after training (0 skips the evaluation)"""
    progress_bar: bool = True
    """show a live progress bar with SPS, the recent return and the time left"""


RUN_FLAGS = [f.name for f in fields(RunFlags) if f.name != "sweep"]
"""The flags a --resume may change (not --sweep: its runs are the checkpoint's); the others are the algorithm's."""


def check_flags(args, rules: dict[str, tuple[bool, str]]) -> None:
    """UsageError for the first flag of `{name: (ok, rule)}` that breaks its rule."""
    for name, (ok, rule) in rules.items():
        if not ok:
            raise UsageError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}")


def with_flags(args, **changes):
    """`dataclasses.replace(args, **changes)`; a rule of `Args.__post_init__` broken (its ValueError), a float flag
    that is not finite (a rule's "> 0" passes inf), a seed EnvPool or JAX cannot take, a folder in the name: a
    UsageError."""
    try:
        args = replace(args, **changes)
    except ValueError as e:
        raise UsageError(str(e)) from None
    floats = {f.name: getattr(args, f.name) for f in fields(args) if isinstance(getattr(args, f.name), float)}
    rules = {name: (math.isfinite(value), "finite") for name, value in floats.items()}
    rules["seed"] = (0 <= getattr(args, "seed", 0) <= 2_000_000_000, "in [0, 2,000,000,000] (32-bit seeds)")
    rules["exp_name"] = (not {"/", os.sep} & set(args.exp_name), "a name, not a path (no /)")
    check_flags(args, rules)
    return args


def script_file(Args: type) -> str:
    """The file name of the script that defines `Args` (a copy's own name): a checkpoint says which script wrote it."""
    module = sys.modules.get(Args.__module__)
    return os.path.basename(getattr(module, "__file__", None) or f"{Args.__module__}.py")


def your_line(frames) -> str:
    """ "file:line" of the innermost of `frames` (a traceback's) outside torch: the line of yours that did it."""
    here = [f for f in frames if not f.filename.startswith(os.path.dirname(torch.__file__))]
    return f"{here[-1].filename}:{here[-1].lineno}"
