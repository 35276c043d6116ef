"""Helpers shared by the benchmark scripts (the training scripts themselves share nothing)."""

from __future__ import annotations

import glob
import json
import os
import platform
import tempfile

import torch


def cores() -> int:
    """CPU cores this process may run on (os.sched_getaffinity is Linux-only: elsewhere, all cores)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine(*libraries) -> str:
    """'CPU model, N cores, torch X, lib Y, ..., GPU name' for the table's heading."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    parts = [model, f"{cores()} cores", f"torch {torch.__version__}"]
    parts += [f"{lib.__name__} {lib.__version__}" for lib in libraries]
    if torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name()}")
    return ", ".join(parts)


def train_and_summarize(module, args, workdir: str | None = None) -> dict:
    """Run `module.train(args)` in `workdir` (a scratch folder when None) and return its new summary.json."""
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(workdir or scratch)
        try:
            before = set(glob.glob("runs/*"))
            module.train(args)
            (run,) = set(glob.glob("runs/*")) - before
            with open(os.path.join(run, "summary.json")) as f:
                return json.load(f)
        finally:
            os.chdir(cwd)
