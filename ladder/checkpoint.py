"""checkpoint.pt written atomically and read back (--resume, --load-model), summary.json, loading in place."""

import contextlib
import json
import os
import pickle
import textwrap
from typing import Optional

import torch

from ladder.flags import UsageError


def read_summary(folder: Optional[str]) -> Optional[dict]:
    if folder is None or not os.path.isfile(path := os.path.join(folder, "summary.json")):
        return None
    with open(path) as f, contextlib.suppress(ValueError):  # not JSON: cut short by a kill amid its writing, ...
        if isinstance(summary := json.load(f), dict):
            return summary
    raise UsageError(f"{path} is not a run's summary (not a JSON object): move it away, or give another folder")


def read_checkpoint(path: str, script: str, flag: str = "--resume") -> dict:
    """The checkpoint at `path` (or in it) on the CPU, unless another script wrote it; K runs' aggregate folder: the
    first's, with the flags they were started with (--num-seeds, --sweep)."""
    file = os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path
    if not os.path.isfile(file) and (summary := read_summary(path)) and summary.get("run_dirs"):
        args = {k: tuple(v) if isinstance(v, list) else v for k, v in summary["args"].items()}  # (JSON's --sweep)
        return read_checkpoint(summary["run_dirs"][0], script, flag) | {"args": args}
    if not os.path.isfile(file):
        where = "a folder with no checkpoint.pt" if os.path.isdir(path) else "no such file or folder"
        raise UsageError(f"{flag} {path}: {where}")
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, or holding objects other than plain data
        said = str(e).strip() if isinstance(e, (RuntimeError, pickle.UnpicklingError)) else ""  # (an empty file: EOF)
        cause = textwrap.shorten(said.splitlines()[0].split(". ")[0], 80) if said else "not a torch file"
        raise UsageError(f"{flag} {file} is not a readable checkpoint ({cause})") from None
    writer = saved.get("script", script) if isinstance(saved, dict) else f"something else (a {type(saved).__name__})"
    if writer != script:
        raise UsageError(f"{flag} {file} was written by {writer}, not {script}")
    if flag == "--resume" and "counters" not in saved:
        raise UsageError(f"--resume {file} holds weights only; evaluate them with --eval-only --load-model")
    return saved


def write_atomically(path: str, contents) -> None:
    """`contents` saved at `path` (a .json path: as JSON) through a temporary file, then renamed: a kill mid-write
    leaves the old file."""
    with open(path + ".tmp", "wb") as f:
        if path.endswith(".json"):
            f.write(json.dumps(contents, indent=2).encode())
        else:
            torch.save(contents, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename, so a crash cannot leave a renamed empty file
    os.replace(path + ".tmp", path)


def state(obj):
    return obj if torch.is_tensor(obj) else obj.state_dict()


def load_in_place(obj, saved) -> None:
    """`obj` as `saved` has it, in place; an optimizer's param groups stay the dicts they were (torch's makes new ones:
    a reference the code took to one, to anneal its rate, would go dead)."""
    if torch.is_tensor(obj):
        obj.copy_(saved)
        return
    groups = obj.param_groups if isinstance(obj, torch.optim.Optimizer) else None
    obj.load_state_dict(saved)
    if groups is not None:
        for group, loaded in zip(groups, obj.param_groups):
            group.update(loaded)
        obj.param_groups = groups
