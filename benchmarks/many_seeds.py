"""K seeds to a fixed number of env steps each, wall time from launch to the last result and the peak memory, all in
one run: ppo_cartpole_gpu.py run K times one after another (CleanRL's way), the same with `--num-seeds K` in one
process, the JAX peer (benchmarks/jax_ppo_cartpole.py) run K times, and the JAX peer with all
K seeds `jax.vmap`ped in one program (PureJaxRL's headline). Prints markdown tables with the command and the machine.

    python benchmarks/many_seeds.py                                   # 16 seeds x 500k steps, ~20 minutes on 2 cores
    python benchmarks/many_seeds.py --seeds 4 --steps 200000
    python benchmarks/many_seeds.py --scaling 1 4 16 64 --steps 100000 --plot docs/many_seeds.png  # time per seed
    python benchmarks/many_seeds.py --brax 8 --steps 100000            # Brax inverted_pendulum, 8 seeds
    python benchmarks/many_seeds.py --statistics 16   # the defaults to the target: --num-seeds 16 learns as 16 runs?
    python benchmarks/many_seeds.py --profile 16 --steps 100000  # where --num-seeds 16's time goes, by part and op
    python benchmarks/many_seeds.py --compile                   # adds --num-seeds 16 --compile (warm cache) as a row
    python benchmarks/many_seeds.py --flat 16 256   # the host's work against K: 40 tiny iterations, K = 16 and 256
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import jax
import numpy as np
import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ladder.checkpoint import read_summary  # noqa: E402
from ladder.statistics import aggregate, line  # noqa: E402 (the scripts' own aggregate)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class ManySeedsArgs:
    seeds: int = 16
    """K: seeds 1..K"""
    steps: int = 500_000
    """env steps per seed (no target: every run goes the whole way)"""
    compile: bool = False
    """a row for `--num-seeds K --compile` on a warm inductor cache (a first run, not timed, fills it): the compile
    seconds of both are printed apart; with --profile: the compiled stacked call's profile (iteration 1 apart)"""
    scaling: list[int] = field(default_factory=list)
    """instead: wall time per seed of `--num-seeds K` for each K given (and 1), in one process each"""
    plot: Optional[str] = None
    """with --scaling: a PNG of the time per seed against K"""
    brax: int = 0
    """instead: this many seeds of ppo_mujoco_brax.py's inverted_pendulum, one after another against --num-seeds"""
    statistics: int = 0
    """instead: this many seeds at the defaults (to the target), a process each against --num-seeds: do they learn
    alike? Their aggregates, and a permutation test of their steps to solve"""
    profile: int = 0
    """instead: where the time of `--num-seeds` this many goes (--steps each, in this process, the default device):
    the stacked calls, `run.each`, the seeds' logs, the rest; and the top ops of one stacked call"""
    tiny: bool = False
    """with --profile: FLAT's sizes (4 envs x 8 steps, 2 minibatches, one thread), where the host's work shows"""
    flat: list[int] = field(default_factory=list)
    """instead: the host's work against K, for each K given (e.g. 16 256): the small command FLAT (4 envs x 8 steps,
    40 iterations, one thread, a process each) timed from launch to exit, and its training seconds"""


FLAT = ["--num-envs", "4", "--num-steps", "8", "--num-minibatches", "2", "--total-timesteps", "1280", "--target-return",
        "None", "--eval-episodes", "0", "--no-progress-bar", "--torch-threads", "1"]  # fmt: skip
"""40 iterations so small that the host's work is most of each: `ppo_cartpole_gpu.py --num-seeds K` + FLAT."""


def flat(ks: list[int], py: str, script: str) -> None:
    """`--num-seeds K` + FLAT for each K, one fresh process each: the training seconds (summary.json's wall_seconds),
    launch to exit, and the two against the first K's (training ratio: the host's work per iteration against K). Beside
    it the JAX peer vmapped over K at FLAT's sizes, on one thread too: its training seconds (iterations 2-40, after
    compiling) against the first K's, the growth with K of a program with no host work per seed at all."""
    rows = []
    peer = [py, os.path.join(ROOT, "benchmarks", "jax_ppo_cartpole.py"), "--num-envs", "4", "--num-steps", "8",
            "--num-minibatches", "2", "--total-timesteps", "1280", "--target-return", "inf"]  # fmt: skip
    one_thread = dict(os.environ, XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    for k in ks:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            subprocess.run([py, script, "--num-seeds", str(k), *FLAT], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
            total = time.perf_counter() - start
            seeds = [s for s in map(read_summary, glob.glob(os.path.join(tmp, "runs", "*"))) if "run_dirs" not in s]
        out = subprocess.run(peer + ["--num-seeds", str(k)], env=one_thread, capture_output=True, text=True, check=True)
        rows.append(
            (k, seeds[0]["wall_seconds"], total, json.loads(out.stdout.strip().splitlines()[-1])["wall_seconds"])
        )
    print(f"\n`ppo_cartpole_gpu.py --num-seeds K {' '.join(FLAT)}`, one process each; the JAX peer vmapped over K")
    print("at the same sizes, one XLA thread (training: iterations 2-40)\n")
    print("| K | training s | launch to exit s | outside training s | training vs first K | JAX peer training s | "
          "JAX vs first K |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for k, train, total, jax_s in rows:
        print(f"| {k} | {train:.2f} | {total:.1f} | {total - train:.1f} | {train / rows[0][1]:.2f}x | {jax_s:.3f} | "
              f"{jax_s / rows[0][3]:.2f}x |")  # fmt: skip


def timed(commands: list[list[str]], cache: Optional[str] = None) -> tuple[float, float, Optional[list[float]]]:
    """Seconds to run `commands` one after another, each a fresh process in a scratch folder (cold caches, or the
    inductor cache `cache`); the largest peak resident memory of one of them, in MiB (os.wait4: that child's own);
    their seconds of compiling (iteration 1) and of training (summary.json's), added up (None: no run folder)."""
    start, peak, parts = time.perf_counter(), 0.0, None
    for command in commands:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache or os.path.join(tmp, "inductor"))
            proc = subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _, status, usage = os.wait4(proc.pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"failed: {' '.join(command)}\n{proc.stderr.read().decode()[-2000:]}")
            proc.stderr.close()
            peak = max(peak, usage.ru_maxrss / 1024)  # KiB on Linux
            seeds = [s for s in map(read_summary, glob.glob(os.path.join(tmp, "runs", "*"))) if "run_dirs" not in s]
            if seeds:  # (the JAX peer writes no run folder; K seeds in one process: the same seconds each)
                mine = max(s["setup_parts"].get("compiled", 0.0) for s in seeds), max(s["wall_seconds"] for s in seeds)
                parts = [a + b for a, b in zip(parts or [0.0, 0.0], mine)]
    return time.perf_counter() - start, peak, parts


def table(title: str, rows: dict[str, list[list[str]] | tuple], k: int) -> dict[str, float]:
    """Time each row's commands (or `timed`'s arguments), print the markdown table (the first row: the ratios' base)."""
    results = {}
    for label, commands in rows.items():
        results[label] = timed(*commands) if isinstance(commands, tuple) else timed(commands)
        print(f"  {label}: {results[label][0]:.1f} s", file=sys.stderr, flush=True)
    base = next(iter(results.values()))[0]
    print(f"\n| {title} | wall s, launch to last result | per seed | vs the first row | peak memory of a process |")
    print("|---|---|---|---|---|")
    for label, (seconds, peak, _) in results.items():
        print(f"| {label} | {seconds:.1f} | {seconds / k:.1f} | {base / seconds:.2f}x | {peak:,.0f} MiB |")
    print("\n| row | compiling s (iteration 1) | training s (wall_seconds, added up) |\n|---|---|---|")
    for label, (_, _, parts) in results.items():
        if parts is not None:
            print(f"| {label} | {parts[0]:.1f} | {parts[1]:.1f} |")
    return {label: seconds for label, (seconds, _, _) in results.items()}


def rank_sum_p(a: np.ndarray, b: np.ndarray, reps: int = 100_000, seed: int = 0) -> float:
    """Two-sided permutation p-value of the difference in mean rank between samples `a` and `b` (Mann-Whitney's
    statistic; ties share their mean rank, so runs that never solved, at inf, rank last together)."""
    x = np.concatenate([a, b])
    ranks = np.empty(len(x))
    ranks[x.argsort(kind="stable")] = np.arange(1, len(x) + 1)
    for value in np.unique(x):
        ranks[x == value] = ranks[x == value].mean()
    observed = abs(ranks[: len(a)].mean() - ranks[len(a) :].mean())
    rng = np.random.default_rng(seed)
    shuffled = np.array([rng.permutation(ranks) for _ in range(reps)])
    gaps = np.abs(shuffled[:, : len(a)].mean(1) - shuffled[:, len(a) :].mean(1))
    return float((gaps >= observed - 1e-12).mean())


def statistics(k: int, py: str, script: str) -> None:
    """K runs of the defaults, one process each, and --num-seeds K: each side's aggregate line and the test."""
    with tempfile.TemporaryDirectory() as tmp:
        for command in [[py, script, "--seed", str(s), "--exp-name", "apart"] for s in range(1, k + 1)] + [
            [py, script, "--num-seeds", str(k), "--exp-name", "stacked"]
        ]:
            subprocess.run(command + ["--no-progress-bar"], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        folders = {name: sorted(glob.glob(os.path.join(tmp, "runs", f"*__{name}__*"))) for name in ("apart", "stacked")}
        sides = {name: [s for s in map(read_summary, runs) if "run_dirs" not in s]  # the --num-seeds aggregate aside
                 for name, runs in folders.items()}  # fmt: skip
    steps = {n: np.array([s["solved_at_step"] or np.inf for s in v], dtype=float) for n, v in sides.items()}
    print(f"\n| {k} seeds of the defaults, to the target | aggregate |\n|---|---|")
    print(f"| {k} processes, one seed each | {line(aggregate(sides['apart']))} |")
    print(f"| `--num-seeds {k}`, one process | {line(aggregate(sides['stacked']))} |")
    for name, v in steps.items():
        print(f"\n{name}: steps to solve {', '.join(f'{x:,.0f}' for x in sorted(v))}")
    p = rank_sum_p(steps["apart"], steps["stacked"])
    print(f"\nsteps to solve, apart against stacked: two-sided permutation p = {p:.2f} (mean ranks, 100,000 shuffles)")


def profile(k: int, steps: int, tiny: bool = False, compile: bool = False) -> None:
    """--num-seeds K timed by part: the stacked calls (the vmapped iteration, all seeds' device work), `run.each` (the
    seeds' noise, all drawn in one vmapped call), the logs (one host read, the seeds' counters in arrays, the outputs
    every 10 s), and the rest (the loop's Python, the set-up); then the ops that took the most time in the third
    stacked call (torch.profiler). `compile`: the stacked call compiled, its first (compiling) call left out."""
    import functools

    from torch.profiler import profile as torch_profile

    import ladder.run
    import ladder.stacked
    import ppo_cartpole_gpu as P

    args = P.Args(num_seeds=k, total_timesteps=steps, target_return=None, progress_bar=False, eval_episodes=0,
                  compile=compile)  # fmt: skip
    if tiny:
        args = replace(args, num_envs=4, num_steps=8, num_minibatches=2, total_timesteps=1280)
        torch.set_num_threads(1)
    gpu = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if gpu else lambda: None  # time the device's work too
    seconds, calls, ops = {}, [0], []

    def clocked(name: str, fn):  # its seconds added up under `name`
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                sync()
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    call_as_written = ladder.stacked.Stacked.call

    def call(stack, fn, *inputs, **how):
        if fn.__name__ != "one_iteration":  # `run.each`'s calls: counted there
            return call_as_written(stack, fn, *inputs, **how)
        calls[0] += 1
        if calls[0] == 1 and compile:  # compiling: not training time, as in the script's own clock
            return clocked("compiling", call_as_written)(stack, fn, *inputs, **how)
        if calls[0] != 3:  # the third: warm (a CUDA graph recorded, a compiled graph built); it and the profiler's
            return clocked("calls", call_as_written)(stack, fn, *inputs, **how)  # own cost are left out of the times
        start = time.perf_counter()
        with torch_profile() as prof:
            out = call_as_written(stack, fn, *inputs, **how)
            sync()
        ops.append(prof)
        seconds["profiled"] = time.perf_counter() - start
        return out

    ladder.stacked.Stacked.call = call
    ladder.run.Run.each = clocked("each", ladder.run.Run.each)
    ladder.run.Run.log = clocked("log", ladder.run.Run.log)
    start = time.perf_counter()
    P.train(args)
    profiled, compiling = seconds.get("profiled", 0.0), seconds.get("compiling", 0.0)
    wall, n = time.perf_counter() - start - profiled - compiling, calls[0] - bool(profiled) - bool(compiling)
    parts = {
        "the stacked calls (the vmapped iteration)": seconds["calls"],
        f"`run.each`: the {k} seeds' noise, in one vmapped call": seconds["each"],
        "the logs: one host read, the counters, the outputs every 10 s": seconds["log"],
        "the rest (the loop's Python, the set-up, the end)": wall - seconds["calls"] - seconds["each"] - seconds["log"],
    }
    size = f"{args.total_timesteps:,} steps each, {args.device}"
    title = f"`--num-seeds {k}{' --compile' * compile}`, {size}: {n} iterations (the profiled one left out)"
    if compile:
        print(f"\nIteration 1 compiled in {compiling:.1f} s, left out below")
    print(f"\n| {title} | s | share | ms per iteration |\n|---|---|---|---|")
    for part, s in {"the whole run": wall, **parts}.items():
        print(f"| {part} | {s:.1f} | {100 * s / wall:.0f}% | {1000 * s / n:.1f} |")
    if ops:
        key = (lambda e: e.self_device_time_total) if gpu else (lambda e: e.self_cpu_time_total)
        averages = ops[0].key_averages()
        total, count = sum(map(key, averages)), sum(e.count for e in averages)
        print(f"\nThe third stacked call: {count:,} op calls, {total / 1e3:.0f} ms of {'GPU' if gpu else 'CPU'} time")
        if not gpu:  # the rest of its wall time: Python and dispatch (vmap's included), what the host adds
            wall_ms = 1e3 * seconds["profiled"]
            print(f"(its wall time, profiled, {wall_ms:.0f} ms: {wall_ms - total / 1e3:.0f} ms outside the ops)")
        print("\n| op | ms | calls |\n|---|---|---|")
        for e in sorted(averages, key=key, reverse=True)[:12]:
            print(f"| `{e.key}` | {key(e) / 1e3:.1f} | {e.count} |")


def main() -> None:
    bench = tyro.cli(ManySeedsArgs)
    k, steps, py = bench.seeds, str(bench.steps), sys.executable
    quiet = ["--eval-episodes", "0", "--no-progress-bar"]
    script = os.path.join(ROOT, "ppo_cartpole_gpu.py")
    ours = [py, script, "--total-timesteps", steps, "--target-return", "None", *quiet]
    print(f"`python {' '.join(sys.argv)}` on {machine(jax)}, {time.strftime('%Y-%m-%d')}", file=sys.stderr)
    if bench.flat:
        flat(bench.flat, py, script)
    elif bench.statistics:
        statistics(bench.statistics, py, script)
    elif bench.profile:
        profile(bench.profile, bench.steps, bench.tiny, bench.compile)
    elif bench.brax:
        k = bench.brax
        brax = [py, os.path.join(ROOT, "ppo_mujoco_brax.py"), "--env-id", "inverted_pendulum", "--total-timesteps",
                steps, "--target-return", "None", *quiet]  # fmt: skip
        table(f"Brax inverted_pendulum, {k} seeds x {bench.steps:,} steps", {
            f"ppo_mujoco_brax.py, {k} runs one after another": [brax + ["--seed", str(s)] for s in range(1, k + 1)],
            f"ppo_mujoco_brax.py --num-seeds {k}": [brax + ["--num-seeds", str(k)]],
        }, k)  # fmt: skip
    elif bench.scaling:
        ks = sorted({1, *bench.scaling})
        seconds = {n: timed([ours + ["--num-seeds", str(n)]]) for n in ks}
        print(f"\n| --num-seeds K, {bench.steps:,} steps each | wall s | per seed | vs K=1, per seed | peak memory |")
        print("|---|---|---|---|---|")
        for n, (s, peak, _) in seconds.items():
            print(f"| {n} | {s:.1f} | {s / n:.2f} | {seconds[1][0] / (s / n):.2f}x | {peak:,.0f} MiB |")
        if bench.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(5, 3.2))
            ax.plot(ks, [seconds[n][0] / n for n in ks], "o-")
            ax.set(xscale="log", xlabel="--num-seeds K (one process)", ylabel="wall seconds per seed",
                   title=f"ppo_cartpole_gpu.py, {bench.steps:,} steps per seed")  # fmt: skip
            ax.set_xticks(ks, [str(n) for n in ks])
            ax.set_ylim(bottom=0)
            fig.tight_layout()
            fig.savefig(bench.plot, dpi=120)
    else:
        peer = [py, os.path.join(ROOT, "benchmarks", "jax_ppo_cartpole.py"), "--total-timesteps", steps,
                "--target-return", "inf"]  # fmt: skip
        one_by_one = [ours + ["--seed", str(s)] for s in range(1, k + 1)]
        rows = {f"ppo_cartpole_gpu.py, {k} runs one after another": one_by_one}
        rows[f"ppo_cartpole_gpu.py --num-seeds {k} (one process)"] = [ours + ["--num-seeds", str(k)]]
        if bench.compile:  # on a warm cache: a first run fills it (the time a first run of these flags takes)
            cache, compiled = tempfile.mkdtemp(), ours + ["--num-seeds", str(k), "--compile"]
            cold, _, (compiling, _) = timed([compiled], cache)
            print(f"  --compile, cold cache: {cold:.1f} s, {compiling:.1f} s of it compiling", file=sys.stderr)
            rows[f"ppo_cartpole_gpu.py --num-seeds {k} --compile (warm cache)"] = ([compiled], cache)
        rows[f"JAX peer, {k} runs one after another"] = [peer + ["--seed", str(s)] for s in range(1, k + 1)]
        rows[f"JAX peer, --num-seeds {k} (vmapped, one process)"] = [peer + ["--seed", "1", "--num-seeds", str(k)]]
        seconds = table(f"{k} seeds x {bench.steps:,} steps", rows, k)
        ours_k, jax_k = seconds[f"ppo_cartpole_gpu.py --num-seeds {k} (one process)"], list(seconds.values())[-1]
        print(f"\n--num-seeds {k} against the JAX peer vmapped: {jax_k / ours_k:.2f}x (above 1: ours is faster)")
        for label in [label for label in seconds if "--compile" in label]:
            print(f"{label} against the JAX peer vmapped: {jax_k / seconds[label]:.2f}x")
    print(f"\n`python {' '.join(sys.argv)}` on {machine(jax)}, {torch.get_num_threads()} torch threads by default")


if __name__ == "__main__":
    main()
