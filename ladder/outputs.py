"""A run folder's outputs: TensorBoard, W&B (--track), the progress bar or a plain line now and then, videos."""

import importlib
import math
import os
import sys
import time
from dataclasses import asdict

from tqdm import tqdm

from ladder.flags import UsageError

PROGRESS_LINE_SECONDS = 30.0  # without a terminal (nohup, CI): a plain progress line this often, for the bar


class Outputs:
    """Rank 0's outputs of one run folder; TensorBoard's writer is opened at the first scalars written."""

    def __init__(self, dir: str, args, wandb_id, total_steps: int, done_steps: int, resumed: bool):
        self.dir, self.args, self.writer, self.wandb, self.progress, self.last_line = dir, args, None, None, None, None
        self.purge_step = done_steps + 1 if resumed else None  # events logged after the checkpoint are hidden
        if args.track:  # a W&B run of its own (--num-seeds: K runs in one process), given the scalars by `write`
            wandb = importlib.import_module("wandb")
            settings = dict(project=args.wandb_project_name, entity=args.wandb_entity, group=args.wandb_group)
            this_run = dict(name=os.path.basename(dir), id=wandb_id, resume="allow", config=asdict(args))
            try:
                self.wandb = wandb.init(reinit="create_new", **settings, **this_run)
            except Exception as e:  # no login, no network, a bad WANDB_ setting: one line saying the way round
                said = " ".join(str(e).split())  # (its words over several lines)
                raise UsageError(f"--track: {said} (or WANDB_MODE=offline, synced later by `wandb sync`)") from None
            self.wandb.define_metric("*", step_metric="global_step")  # TensorBoard's x-axis
        if args.progress_bar and not args.eval_only and sys.stderr.isatty():  # a log file would fill with redraws
            end = None if args.target_return is None else f"until return {args.target_return:g}"  # or the ETA's end
            self.progress = tqdm(total=total_steps, initial=done_steps, unit_scale=True, desc=end)
        elif args.progress_bar and not args.eval_only:  # no terminal: a line now, after iteration 1, every 30 s
            self.last_line = -math.inf
            print(f"{dir}: training on {args.device}, {total_steps:,} steps", file=sys.stderr)

    def write(self, rows: list) -> None:
        """Rows (env step, {tag: number}), each one TensorBoard event (add_scalar costs ~0.1 ms a tag) and W&B row."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter  # (imported, ~0.5 s, by a run that writes)
        from torch.utils.tensorboard.summary import hparams

        if self.writer is None:
            self.writer = SummaryWriter(self.dir, purge_step=self.purge_step)
            table = "".join(f"\n|{key}|{value}|" for key, value in asdict(self.args).items())
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|" + table)
            flags = {k: v if isinstance(v, (int, float, str)) else str(v) for k, v in asdict(self.args).items()}
            for summary in hparams(flags, {"charts/episodic_return": 0, "eval/episodic_return": 0}):  # HPARAMS tab
                self.writer.file_writer.add_summary(summary)
        for step, values in rows:
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
            self.writer.file_writer.add_summary(summary, step)
            if self.wandb is not None:  # not W&B's sync_tensorboard: it follows one run per process
                self.wandb.log(values | {"global_step": step})
        self.writer.flush()  # on disk now (its own writer keeps events up to 120 s)

    def show(self, steps: int, done: int, total: int, sps, recent: str, label: str = "") -> None:
        """The progress bar moved on by `steps`, or, without a terminal, a line every 30 s."""
        if self.progress is not None:
            self.progress.update(steps)
            self.progress.set_postfix(SPS=sps, ret=f"{label}{recent}", refresh=False)
        elif self.last_line is not None and time.perf_counter() - self.last_line >= PROGRESS_LINE_SECONDS:
            self.last_line = time.perf_counter()
            speed = f"{sps:,} SPS, {tqdm.format_interval(max(total - done, 0) / sps)} left" if sps else "compiling"
            print(f"{label}{done:,}/{total:,} steps, {speed}, return {recent}", file=sys.stderr)

    def video(self, path: str, key: str) -> None:
        if self.wandb is not None and os.path.exists(path):
            self.wandb.log({key: sys.modules["wandb"].Video(path, format="mp4")})

    def close(self, eval_mean, step: int) -> None:
        if self.progress is not None:
            self.progress.total = self.progress.n  # the bar ends where training ended
            self.progress.close()
        self.write([(step, {"eval/episodic_return": eval_mean})] if eval_mean is not None else [])
        self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
