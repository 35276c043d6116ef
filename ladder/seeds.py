"""A run's seeds (K with --num-seeds, K per configuration with --sweep, each a run of its own: seed.py, stacked:
stacked.py), from start to end."""

import math
import os
import time
from dataclasses import asdict

import torch

from ladder.checkpoint import read_summary, write_atomically
from ladder.flags import UsageError, script_file, with_flags
from ladder.progress import Progress
from ladder.seed import Seed, new_folder
from ladder.stacked import Stacked
from ladder.statistics import aggregate, line
from ladder.sweep import config_name, sweep_grid, table, write_ranking


class Seeds:
    """`runs`: a Seed each as `run.start` builds it; `dir`: the aggregate folder (one seed: None); `stack`: K's."""

    def __init__(self, args, rank: int, world_size: int):
        self.args, self.rank, self.world_size = args, rank, world_size
        self.started = int(time.time())  # every folder's {time}: the seeds' alike, however long each takes to build
        self.grid = sweep_grid(args) if args.sweep else [{}]  # --sweep: the configurations
        self.dir, self.flags = seeds_flags(args, self.grid, world_size, self.started)
        self.k = len(self.flags)
        self.progress, self.runs, self.observations, self.stack = Progress(self.k), [], [], None
        self.rows, self.flushed = [], -math.inf  # the scalars not written yet (the first iteration's: at once)

    def add(self, objects: dict, per_rank: set, obs, total_steps: int, note):
        """The next seed's run opened; the last's stacks the K seeds and their observations (`None` before)."""
        if len(self.runs) == self.k:
            raise UsageError(f"run.start is called once for each of {self.k} runs, in `for args in run.args_per_run:`")
        flags, script = self.flags[len(self.runs)], script_file(type(self.args))
        seed = Seed(len(self.runs), flags, script, self.progress, self.rank, self.world_size, self.started)
        seed.says_result = len(self.grid) == 1  # a sweep's runs: its table says them
        self.runs.append(seed)
        say = note if seed.index == 0 else lambda message: None  # seeds 2 to K: the first seed's notes say it for all
        self.observations.append(seed.open(objects, per_rank, obs, total_steps, say))
        if len(self.runs) < self.k or self.k == 1:
            return self.observations[-1]
        if len({run.saved and run.saved["counters"]["iteration"] for run in self.runs}) > 1:
            raise UsageError(f"--resume {self.args.resume}: its seeds stopped at different iterations")
        self.stack = Stacked([run.objects for run in self.runs], self.flags, list(self.grid[0]))
        seed.own = self.stack.as_last_seed  # the lead's objects are the last seed's own
        write_aggregate(self.dir, [run.dir for run in self.runs], self.args, self.grid, final=False)
        return None if obs is None else torch.stack(self.observations)

    def report(self, tags: list, columns, steps: int, total_steps: int) -> None:
        """Rank 0's outputs of an iteration: each seed's scalars (written every 10 s) and the progress bar."""
        p = self.progress
        self.rows.append((p.global_step, tags, columns))
        if time.perf_counter() - self.flushed >= 10.0:  # and at each checkpoint (run.checkpoint)
            self.flush()
        recent = f"{p.mean(full=False)[0]:.1f} (last {min(p.count[0], 100)})" if p.count[0] else "none yet"
        label = "seed 1: " if self.k > 1 else ""
        if self.args.sweep:
            label = f"{len(self.grid)} configurations x {self.args.num_seeds} seeds, the first's: "
        self.runs[0].outputs.show(steps, p.global_step, total_steps, p.sps(), recent, label)

    def flush(self) -> None:
        """The scalars since the last flush to each seed's TensorBoard and W&B (a NaN statistic: no value)."""
        numbers = lambda tags, values: {tag: float(v) for tag, v in zip(tags, values) if math.isfinite(v)}
        for seed, run in enumerate(self.runs if self.rows else ()):  # (rank 0's alone: it alone reports)
            run.outputs.write([(step, numbers(tags, row[seed])) for step, tags, row in self.rows])
        self.rows, self.flushed = [], time.perf_counter()

    def finish(self, exc_type, exc, stopped: int, setup: dict, evaluate, note) -> int:
        """Each seed's end (checkpoint, model, evaluation, summary.json, result), their aggregate; the signal, or 0."""
        at_end = isinstance(exc, KeyboardInterrupt) and len(exc.args) == 1  # at an iteration's end, by a signal
        causes = {KeyboardInterrupt: "interrupted", FloatingPointError: "non-finite loss", UsageError: "refused"}
        status = causes.get(exc_type, "error") if exc else "evaluated" if self.args.eval_only else "completed"
        whole = (exc is None or at_end) and len(self.runs) == self.k  # the state is whole: a checkpoint
        if self.stack and whole:
            self.stack.share_lead()
        self.flush()
        for seed, run in enumerate(self.runs):
            reached = status == "completed" and self.progress.target_reached[seed]
            status_k = "target return reached" if reached else status
            stopped = run.finish(status_k, whole, stopped, setup, evaluate, note if seed == 0 else lambda message: None)
        if self.k > 1 and self.rank == 0 and len(self.runs) == self.k and status not in ("refused", "interrupted"):
            write_aggregate(self.dir, [run.dir for run in self.runs], self.args, self.grid, final=True)
        if isinstance(exc, KeyboardInterrupt) and self.runs and self.runs[0].checkpointed >= 0:  # (at once: an older)
            exc.resume = self.dir or self.runs[0].dir  # main's last line: the command that goes on from it
        if self.stack:  # the objects train() returns: the last seed's own state
            self.stack.release()
        return stopped


def seeds_flags(args, grid: list[dict], world_size: int, started: int) -> tuple:
    """The aggregate folder and each run's flags: --num-seeds K, K runs per configuration of a --sweep `grid` (the
    first films, shows progress); --resume, --load-model from the aggregate's folders; one run: (None, [its flags])."""
    k, first, n = args.num_seeds, args.seed, args.num_seeds * len(grid)
    # a run folder (its checkpoint.pt) is read no further: under torchrun rank 0 may still be writing its summary.json
    path = args.resume or args.load_model
    aggregate = n > 1 or path and not os.path.isfile(os.path.join(path, "checkpoint.pt"))
    saved = (aggregate and read_summary(path)) or {}
    dirs, flag = saved.get("run_dirs"), "--resume" if args.resume else "--load-model"
    if args.load_model and dirs and saved["args"]["sweep"]:  # its runs are configurations, not seeds of one
        raise UsageError(f"--load-model {args.load_model}: a --sweep's aggregate; evaluate one of its run folders")
    if n == 1 and dirs and args.resume:  # an aggregate's runs, as one run: it would write over the aggregate's files
        raise UsageError(f"--resume {args.resume}: the aggregate of {len(dirs)} runs, give --num-seeds {len(dirs)}")
    if n == 1:  # (every run's flags go through with_flags: train()'s caller's too, not the CLI's alone)
        return None, [with_flags(args, sweep=(), **grid[0])]
    if world_size > 1:
        what = "--sweep runs its configurations" if args.sweep else "--num-seeds stacks the seeds"
        raise UsageError(f"{what} in one process: under torchrun, use --num-seeds 1 and no --sweep")
    if (args.resume or dirs) and len(dirs or []) != n:
        seeds = f"--num-seeds {k} takes the aggregate folder of {k} seeds (runs/..__{first}-{first + k - 1}__..)"
        held = f" ({path} holds {len(dirs)}: the --num-seeds it had?)" if dirs else ""
        runs = f"this --sweep takes the aggregate folder of its {n} runs{held}" if args.sweep else seeds
        raise UsageError(f"{flag} with {runs}" + (", or --load-model one model for all" if args.load_model else ""))
    if args.resume and all(finished(d, args) for d in dirs):  # as a seed's resume says for one seed
        more = "raise --total-timesteps, or pass --target-return None (or a higher one)"
        raise UsageError(f"--resume {args.resume}: each seed has ended; to train on, {more}")
    sweep = f"{len(grid)}-configurations__" if args.sweep else ""
    folder = args.resume or new_folder(f"{args.env_id}__{args.exp_name}__{sweep}{first}-{first + k - 1}", started)
    group = args.wandb_group or os.path.basename(os.path.normpath(folder))  # --track: a W&B run per seed, one group

    def run(i: int):
        config, resume, model = grid[i // k], args.resume and dirs[i], dirs[i] if dirs and args.load_model else None
        # a sweep's run: its values in its name (its folder's, W&B's); the first run films and shows the progress
        name = f"{args.exp_name}-{config_name(config)}" if args.sweep else args.exp_name
        shown = dict(capture_video=args.capture_video and i == 0, progress_bar=args.progress_bar and i == 0)
        flags = dict(seed=first + i % k, num_seeds=1, sweep=(), exp_name=name, wandb_group=group, **config, **shown)
        return with_flags(args, resume=resume, load_model=model or args.load_model, **flags)

    return folder, [run(i) for i in range(n)]


def finished(run_dir: str, args) -> bool:
    """Whether `run_dir`'s run has ended as `args` would end it (its resume would be refused)."""
    s = read_summary(run_dir) or {"status": None}
    done = s["status"] == "completed" and s["args"]["total_timesteps"] >= args.total_timesteps
    return done or s["status"] == "target return reached" and s["args"]["target_return"] == args.target_return


def write_aggregate(folder: str, dirs: list[str], args, grid: list[dict], final: bool) -> None:
    """The aggregate folder's summary.json: the runs' folders (for --resume), at the end their statistics and line,
    or a --sweep's ranking of its configurations (ranking.csv, ranking.json, learning_curves.png)."""
    summaries = [summary for summary in map(read_summary, dirs if final else []) if summary is not None]
    agg = aggregate(summaries) if summaries and not args.sweep else {}  # a sweep's: per configuration (ranking.json)
    if args.eval_only:  # nothing trained: no counts of runs that reached the target or solved
        agg = {key: value for key, value in agg.items() if key in ("runs", "seeds") or key.startswith("eval")}
    os.makedirs(folder, exist_ok=True)
    s = {"run_dirs": dirs, "num_seeds": args.num_seeds, **agg, "args": asdict(args)}
    write_atomically(os.path.join(folder, "summary.json"), s)
    if final and args.sweep and len(summaries) == len(dirs):
        rows = write_ranking(folder, grid, dirs, summaries)
        print(f"{len(grid)} configurations x {args.num_seeds} seeds, ranked:\n{table(rows)}\noutputs in {folder}")
    elif final and summaries:
        print(f"{len(dirs)} seeds: {line(agg)}; outputs in {folder}")
