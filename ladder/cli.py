"""The command line: the flags parsed and checked, torchrun joined, `train` run, its end turned into one line."""

import contextlib
import difflib
import gc
import importlib.util
import io
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import FrozenInstanceError, fields, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import tyro

from ladder.checkpoint import read_checkpoint
from ladder.flags import RUN_FLAGS, UsageError, check_flags, script_file
from ladder.signals import interrupt


def check_run_flags(args) -> torch.device:
    counts = ("eval_episodes", "torch_threads", "video_interval", "checkpoint_interval")
    gpus = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # found; needed: one per process
    cuda = args.device.split(":")[0] == "cuda" and gpus[0] >= gpus[1]
    rules = {name: (getattr(args, name) >= 0, ">= 0") for name in counts}
    needs = f"cpu, or cuda with a CUDA GPU per process ({gpus[0]} found, {gpus[1]} needed)"
    rules["device"] = (args.device == "cpu" or cuda, needs)
    check_flags(args, rules)
    compiler = os.environ.get("CXX", {"win32": "cl", "darwin": "clang++"}.get(sys.platform, "g++"))  # inductor's
    if args.compile and args.device == "cpu" and not shutil.which(compiler):
        raise UsageError("--compile on the CPU needs a C++ compiler: install g++ (or set CXX), or leave out --compile")
    pins = {"imageio==2.38.1": "capture_video", "imageio-ffmpeg==0.8.1": "capture_video", "wandb==0.31.0": "track"}
    for pin, flag in pins.items():  # (imageio-ffmpeg: imageio's MP4 writer)
        if getattr(args, flag) and importlib.util.find_spec((package := pin.split("==")[0]).replace("-", "_")) is None:
            raise UsageError(f"--{flag.replace('_', '-')} needs {package}: pip install {pin}")
    if args.eval_only != bool(args.load_model) or (args.resume and args.eval_only):
        raise UsageError("--eval-only and --load-model PATH go together, without --resume (which trains on)")
    if args.eval_only and (args.eval_episodes < 1 or args.sweep):
        raise UsageError("--eval-only plays --eval-episodes (at least 1) with one model's weights: no --sweep")
    if args.resume:  # one rule: the checkpoint's algorithm flags, all but the run's (`RunFlags`), are kept
        saved = read_checkpoint(args.resume, script_file(type(args)))
        algorithm = [name for name in type(args).__dataclass_fields__ if name not in RUN_FLAGS]
        may = ", ".join(f"--{name.replace('_', '-')}" for name in RUN_FLAGS)
        kept = f"the checkpoint's {{}} (--resume may change only {may})"
        theirs = {f.name: f.default for f in fields(args)} | saved["args"]  # (a flag newer than the checkpoint)
        rules = {n: (getattr(args, n) == theirs[n], kept.format(theirs[n])) for n in algorithm}
        check_flags(args, rules)
        if (n := len(saved["ranks"])) != int(os.environ.get("WORLD_SIZE", "1")):
            how = f"torchrun --nproc-per-node {n}" if n > 1 else "one process, python"
            raise UsageError(f"--resume: the checkpoint is of {n} torchrun ranks; resume it with {how}")
    return torch.device(args.device)


def parse_args(Args):
    """tyro's command line, its error box made one `error: ...` line; with --resume, flags left out keep their value
    (--eval-only of a checkpoint: its algorithm's flags, as its --env-id)."""
    argv, default, saved = sys.argv[1:], tyro.MISSING_NONPROP, {}
    if resume := flag_value(argv, "--resume"):
        saved = read_checkpoint(resume, script_file(Args))["args"]
        if any(f == "--sweep" or f.startswith("--sweep=") for f in argv):  # given again: tyro would add it to the saved
            saved = saved | {"sweep": ()}
    elif (model := flag_value(argv, "--load-model")) and "--eval-only" in argv and os.path.exists(model):
        saved = read_checkpoint(model, script_file(Args), "--load-model").get("args", {})
        saved = {k: v for k, v in saved.items() if k not in RUN_FLAGS and k != "sweep"}  # (a sweep's: refused later)
    if saved:
        default = Args(**{k: v for k, v in saved.items() if k in Args.__dataclass_fields__})
    try:
        with contextlib.redirect_stderr(box := io.StringIO()):
            return tyro.cli(Args, default=default)
    except ImportError as e:  # a package the script's `Args` imports to check a flag (`pip install` in its words)
        raise UsageError(str(e)) from None
    except SystemExit as e:
        if e.code != 2:  # --help
            raise
        rows = [row.strip("│|╭╮╰╯ ") for row in box.getvalue().splitlines()]  # a unicode or an ASCII box
        rules = [i for i, row in enumerate(rows) if not row.strip("─-+= ") or row.startswith("─")] + [len(rows)]
        message = " ".join(row for row in rows[rules[0] + 1 : next(i for i in rules if i > rules[0] + 1)] if row)
        hint = rows[rows.index("Perhaps you meant:") + 1].split()[0] if "Perhaps you meant:" in rows else None
        message = re.sub(rf"^Error parsing ({Args.__name__}: )?", "", message)  # (`Args.__post_init__`'s ValueError)
        if unknown := re.match(r"Unrecognized options?: (--[\w-]+)", message):  # not its value, as a second flag
            message = f"unrecognized option {unknown[1]}"
        flag = next((a for a, b in zip(argv, argv[1:]) if b in ("True", "False") and a.startswith("--")), None)
        if flag and re.match(r"Unrecognized options?: (True|False)\b", message):  # CleanRL's argparse: `--track True`
            message = f"{flag} takes no value: {flag} or --no-{flag[2:]}"
        hint = (unknown and flag_meant(unknown[1], Args)) or hint and hint.rstrip(",")  # tyro's lists: "--a, --no-a"
        raise UsageError(message + (f"; did you mean {hint}?" if hint else "")) from None


def flag_value(argv: list[str], flag: str) -> str | None:
    values = [f.split("=", 1)[1] if "=" in f else v for f, v in zip(argv, argv[1:] + [""]) if f.split("=")[0] == flag]
    return values[-1] if values and values[-1] != "None" else None


def flag_meant(flag: str, Args) -> str | None:
    """The flag `flag` abbreviates by initials (--lr: --learning-rate) or misspells, if any."""
    names = [f"--{name.replace('_', '-')}" for name in Args.__dataclass_fields__]
    names += [f"--no-{name[2:]}" for name, field in zip(names, fields(Args)) if field.type in (bool, "bool")]
    initials = {"--" + "".join(word[0] for word in name[2:].split("-")): name for name in names}
    initials |= {"--cuda": "--device cuda", "--no-cuda": "--device cpu"}  # CleanRL's
    return initials.get(flag) or next(iter(difflib.get_close_matches(flag, names, n=1, cutoff=0.75)), None)


class Unread:
    """`stream`, which drops what is written once no one reads it (`| head`, a `less` quit): the run trains on."""

    def __init__(self, stream):
        self.stream = stream

    def __getattr__(self, name: str):  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:  # from now on into /dev/null (the stream's buffer too, flushed at exit)
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())


def run_command_line(Args, train, threaded_from_envs: int = 0) -> None:
    """`python script.py [flags]`: parse, join torchrun, set threads, train; end in one line (2: usage, 1: error)."""
    handler = signal.signal(signal.SIGTERM, interrupt)  # before the run's own handlers (JAX's set-up: seconds)
    streams, (sys.stdout, sys.stderr) = (sys.stdout, sys.stderr), (Unread(sys.stdout), Unread(sys.stderr))
    try:
        args = parse_args(Args)
        device = check_run_flags(args)
        if "LOCAL_RANK" in os.environ:  # torchrun: join the group (a collective waiting 5 minutes fails, not hangs)
            if device.type == "cuda":  # this rank's GPU
                torch.cuda.set_device(device := torch.device("cuda", int(os.environ["LOCAL_RANK"])))
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=5))
        if device.type == "cpu":  # torch's threads, process-wide (so here, not in train()); the ranks share the cores
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            per_rank = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            torch.set_num_threads(args.torch_threads or (per_rank if args.num_envs >= threaded_from_envs else 1))
        train(replace(args, device=str(device)))  # its end syncs the ranks, then rank 0 writes alone
    except UsageError as e:
        rank = int(os.environ.get("RANK", "0"))  # under torchrun every rank finds the same error: rank 0 says it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's stop of the others: quiet, no traceback
        time.sleep(10 if rank else 0)  # once, and torchrun stops the others when it exits (one still here has its own)
        print(f"error: {e}" if rank == 0 else f"error: rank {rank}: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # an unwritable folder, a full disk (the last checkpoint stays: written atomically), ...
        sys.exit(f"error: {e}")  # its errno, its words and its file say it: no guess at a cause
    except FloatingPointError as e:
        sys.exit(f"error: {e}; lower --learning-rate or --max-grad-norm")
    except RuntimeError as e:  # out of memory, on the GPU or the CPU: one line; any other error: its traceback
        if not isinstance(e, torch.cuda.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        sys.exit(f"error: out of memory ({str(e).splitlines()[0][:160]}); lower --num-envs or --num-steps")
    except FrozenInstanceError as e:  # e.g. `args.ent_coef = ...` in train(): a value that changes must be a tensor
        why = "a value derived from them: a variable of yours; one that changes: a tensor, docs/modifying.md"
        sys.exit(f"error: {e}: the flags are fixed for the run ({why}#values-that-change-in-training)")
    except KeyboardInterrupt as e:  # a signal: stopped after an iteration (carrying its number), while compiling
        signum = e.args[0] if e.args else signal.SIGINT  # (its number and why), or a second Ctrl-C
        checkpoint = ", with a checkpoint" if len(e.args) == 1 else ""
        if getattr(e, "resume", None):  # a folder with a checkpoint (stopped at once: the last periodic one's)
            launch = f"torchrun --nproc-per-node {dist.get_world_size()}" if dist.is_initialized() else "python"
            go_on = "go on" if checkpoint else "go on from its last checkpoint"
            checkpoint += f"; {go_on} with: {launch} {sys.argv[0]} --resume {e.resume}"
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"interrupted by {signal.Signals(signum).name}{checkpoint}", file=sys.stderr)
        sys.exit(128 + signum)  # 130 for SIGINT, 143 for SIGTERM
    finally:
        signal.signal(signal.SIGTERM, handler)
        sys.stdout, sys.stderr = streams
        if dist.is_initialized():  # a compiled graph holds the group; dynamo keeps the graphs in the script's globals
            for name in [name for name in vars(sys.modules[train.__module__]) if name.startswith("__compiled_fn")]:
                setattr(sys.modules[train.__module__], name, None)  # (dynamo deletes the name when the graph goes)
            gc.collect()  # (graphs are reference cycles) so the group's threads end with it
            dist.destroy_process_group()
