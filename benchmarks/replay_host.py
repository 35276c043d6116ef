"""The host's time per iteration when the iteration is a replayed CUDA graph, measured on the CPU: ppo_cartpole_gpu.py
with `--cuda-graph` emulated as tests/test_graph.py does, the replay itself a no-op (it returns the outputs recorded
once), so what is left is the Python of one iteration's loop body: annealing the rate, `run.each`'s noise, the
graph's own bookkeeping (inputs copied in, state held, outputs cloned), and `run.log`. On a GPU this is the time the
host needs per iteration besides the replay; where it exceeds the replay, the GPU waits. Prints one markdown table.

    python benchmarks/replay_host.py                        # 128 envs, 300 iterations
    python benchmarks/replay_host.py --num-envs 4096
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_cartpole_gpu as P  # noqa: E402
from common import machine  # noqa: E402
from ladder.cuda_graph import CudaGraph  # noqa: E402
from ladder.run import Run  # noqa: E402


@dataclass
class HostArgs:
    num_envs: int = 128
    """envs (16 steps each, the defaults otherwise)"""
    iterations: int = 300
    """iterations timed (after 10 not timed: the recording, warm caches)"""


def main() -> None:
    bench = tyro.cli(HostArgs)
    torch.set_num_threads(1)
    parts: dict[str, list[float]] = {"loop body": [], "run.log": [], "run.each": [], "the graph's own": []}
    marks = []

    def timed(name: str, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name].append(time.perf_counter() - start)

        return call

    def recorded(self, body):  # the recording runs `body` once; every replay returns what it returned
        out = body()
        return lambda: out

    real_log = Run.log

    def log(self, *args, **kwargs):
        out = timed("run.log", real_log)(self, *args, **kwargs)
        marks.append(time.perf_counter())
        return out

    CudaGraph.devices, CudaGraph.record = ("cuda", "cpu"), recorded
    CudaGraph.__call__ = timed("the graph's own", CudaGraph.__call__)
    Run.log, Run.each = log, timed("run.each", Run.each)
    n = bench.iterations + 10
    args = P.Args(num_envs=bench.num_envs, total_timesteps=n * bench.num_envs * 16, target_return=None,
                  eval_episodes=0, progress_bar=False, device="cpu", cuda_graph=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        P.train(args)
    parts["loop body"] = [b - a for a, b in zip(marks, marks[1:])]
    print(f"`python benchmarks/replay_host.py {' '.join(sys.argv[1:])}`; {machine()}; one thread\n")
    print(f"| {bench.num_envs} envs, replay a no-op: per iteration | median µs | p90 µs |\n|---|---|---|")
    for name, times in parts.items():
        kept = sorted(times[10:])  # the first ones: warm-up and recording
        p90 = kept[int(0.9 * (len(kept) - 1))]
        print(f"| {name} | {1e6 * statistics.median(kept):.0f} | {1e6 * p90:.0f} |")


if __name__ == "__main__":
    main()
