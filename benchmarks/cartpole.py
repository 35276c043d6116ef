"""Speed benchmark for the tensor CartPole and the CartPole scripts, side by side in one run.

Prints three markdown tables (with the command and the machine):
  1. env steps/s, random actions: our torch CartPole, eager and torch.compile'd (as `--compile` runs
     it: 16 steps per graph), vs gymnasium's numpy vector CartPole
     (`gymnasium.make_vec("CartPole-v1", vectorization_mode="vector_entry_point")`);
  2. ppo_cartpole_gpu.py eager, with `--compile`, and a PureJaxRL-style JAX PPO with the same physics
     and hyperparameters (benchmarks/jax_ppo_cartpole.py), at 128x16 and 4096x16: training SPS after
     compilation, and time-to-solve as training-loop seconds and as whole-process seconds (process
     start to solved, compilation included, cold caches: each run is a fresh process);
  3. time-to-solve (training seconds and env steps until the mean return of the last 100
     episodes first reaches 475) of reinforce.py, vpg.py and ppo_cartpole_gpu.py on their
     defaults, and of a CleanRL-style baseline written below (PPO, 4 gymnasium CartPole-v1 envs in
     a SyncVectorEnv, 128 steps, CleanRL's defaults);
  4. training SPS of the CartPole scripts alone and beside one CPU-bound program (a bounded "CPU hog"), with
     the thread defaults of before (one torch thread per core, OpenMP threads spinning while they wait) and of
     now (one thread below 1024 envs, OMP_WAIT_POLICY=PASSIVE): how gracefully a busy laptop slows them.
The time-to-solve runs keep their TensorBoard logs under `--logdir`; benchmarks/plot_curves.py
draws them.

    python benchmarks/cartpole.py                 # everything, ~15 minutes on a 2-core CPU
    python benchmarks/cartpole.py --seeds 1       # one seed per time-to-solve row
    python benchmarks/cartpole.py --seeds 1-10 --skip-peer --skip-busy --skip-baseline --env-sizes 256
                                                  # success rate and spread over 10 seeds
    python benchmarks/plot_curves.py              # the learning-curve PNG from those logs (benchmarks/logs/)
"""

from __future__ import annotations

import glob
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field

import gymnasium as gym
import jax
import numpy as np
import torch
import torch.nn as nn
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_cartpole_gpu as ours  # noqa: E402
import reinforce  # noqa: E402
import vpg  # noqa: E402
from common import cores, machine, train_and_summarize  # noqa: E402


@dataclass
class BenchArgs:
    seeds: str = "1-3"
    """seeds for the time-to-solve rows: a range (1-10) or a list (1,4,7)"""
    env_sizes: list[int] = field(default_factory=lambda: [256, 4096, 16384])
    """numbers of envs for the env step-rate rows"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """device for our env and trainer (the gymnasium env and the baseline run on the CPU)"""
    seconds_per_measure: float = 1.0
    """wall seconds per env step-rate measurement (the best of three is kept)"""
    baseline_max_steps: int = 500_000
    """the baseline gives up after this many env steps (CleanRL's default total)"""
    skip_baseline: bool = False
    """leave out the CleanRL-style baseline (quick runs)"""
    logdir: str = "benchmarks/logs"
    """folder whose runs/ keeps the TensorBoard logs of the time-to-solve runs (emptied first)"""
    peer_sizes: list[int] = field(default_factory=lambda: [128, 4096])
    """--num-envs of the eager / --compile / JAX-peer rows (16 steps each, the other flags default)"""
    peer_seeds: list[int] = field(default_factory=lambda: [1, 2])
    """seeds of the eager / --compile / JAX-peer runs, a whole process each with cold caches: the SPS rows (mean and
    range) and the time-to-solve rows"""
    solve_up_to: int = 1 << 30
    """time-to-solve rows only for --peer-sizes up to this many envs (SPS rows for all)"""
    skip_peer: bool = False
    """leave out the eager / --compile / JAX-peer comparison"""
    skip_busy: bool = False
    """leave out the quiet vs busy-machine (one CPU hog) rows"""


# ----------------------------------------------------------------------------------------------
# 1. env step rate
# ----------------------------------------------------------------------------------------------
def best_rate(step_fn, n_envs: int, seconds: float, repeats: int = 3, sync=lambda: None) -> float:
    """Env steps per second of `step_fn(i)`, the best of `repeats` timed loops of ~`seconds`; `sync()` waits for
    queued work (a GPU's) before each clock read, else a loop would time kernel launches, not kernels."""
    for i in range(10):  # warm-up
        step_fn(i)
    sync()
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        step_fn(k)
        k += 1
    sync()
    steps = max(10, int(k * seconds / (time.perf_counter() - t0)))
    rates = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for i in range(steps):
            step_fn(i)
        sync()
        rates.append(steps * n_envs / (time.perf_counter() - t0))
    return max(rates)


def env_rates(n: int, device: torch.device, seconds: float) -> tuple[float, float, float]:
    """Env steps/s of our CartPole eager, compiled, and of gymnasium's numpy vector env."""
    env = ours.CartPole(n, device, seed=0)
    env.reset()
    actions = torch.randint(0, 2, (64, n), device=device)

    def ours_step(i):
        env.step(actions[i % 64])

    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    rate_ours = best_rate(ours_step, n, seconds, sync=sync)

    # compiled as `--compile` runs it: 16 steps in one graph (as in a 16-step rollout), the reset states
    # drawn up front, inside the timing
    def sixteen_steps(actions, initial_states):
        for t in range(16):
            env.step(actions[t], initial_states[t])

    compiled_steps = torch.compile(sixteen_steps, fullgraph=True)

    def compiled(i):
        compiled_steps(actions[16 * (i % 4) : 16 * (i % 4 + 1)], env.draw_initial_states(16, env.num_envs))

    rate_compiled = 16 * best_rate(compiled, n, seconds, sync=sync)
    ref = gym.make_vec("CartPole-v1", num_envs=n, vectorization_mode="vector_entry_point")
    ref.reset(seed=0)
    np_actions = np.random.default_rng(0).integers(0, 2, size=(64, n))
    rate_ref = best_rate(lambda i: ref.step(np_actions[i % 64]), n, seconds)
    ref.close()
    return rate_ours, rate_compiled, rate_ref


# ----------------------------------------------------------------------------------------------
# 2./3. our trainer
# ----------------------------------------------------------------------------------------------
def run_script(module, logdir: str, **overrides) -> dict:
    """Train `module` (one of the scripts) in `logdir` with the given flag overrides and the thread count its
    main() would pick; return its summary.json."""
    args = module.Args(progress_bar=False, eval_episodes=0, **overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(cores() if args.num_envs >= module.THREADED_FROM_ENVS else 1)
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):  # its result line and notes
            return train_and_summarize(module, args, logdir)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------
# 3. CleanRL-style baseline: CleanRL's ppo.py structure and defaults, written for this benchmark
# ----------------------------------------------------------------------------------------------
class BaselineAgent(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = ours.mlp(4, 1, out_std=1.0)  # CleanRL's networks: the same 64-64 tanh MLPs
        self.actor = ours.mlp(4, 2, out_std=0.01)

    def get_action_and_value(self, x, action=None):
        dist = torch.distributions.Categorical(logits=self.actor(x))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(x).squeeze(-1)


def cleanrl_baseline(seed: int, max_steps: int) -> dict:
    """PPO as CleanRL's ppo.py: 4 envs x 128 steps, lr 2.5e-4 annealed over 500k steps, 4 minibatches,
    4 epochs, gamma 0.99, lambda 0.95, clip 0.2, clipped value loss, ent 0.01, vf 0.5, grad norm 0.5.
    Episodes reset in the same step (as gymnasium 0.29, which CleanRL targets); truncation is
    treated as termination, as CleanRL does."""
    num_envs, num_steps, total, lr = 4, 128, 500_000, 2.5e-4
    gamma, lam, clip, ent_coef, vf_coef, max_grad = 0.99, 0.95, 0.2, 0.01, 0.5, 0.5
    batch, minibatch = num_envs * num_steps, num_envs * num_steps // 4
    torch.manual_seed(seed)
    np.random.seed(seed)  # the minibatch shuffle, as CleanRL seeds it
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    agent = BaselineAgent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5)
    obs = torch.zeros((num_steps, num_envs, 4))
    actions = torch.zeros((num_steps, num_envs), dtype=torch.long)
    logprobs, rewards, dones, values = (torch.zeros((num_steps, num_envs)) for _ in range(4))
    next_obs = torch.tensor(envs.reset(seed=seed)[0])
    next_done = torch.zeros(num_envs)
    ep_ret, recent = np.zeros(num_envs), []
    global_step, start = 0, time.perf_counter()
    num_iterations = total // batch
    for iteration in range(1, num_iterations + 1):
        optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * lr
        for step in range(num_steps):
            global_step += num_envs
            obs[step], dones[step] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[step], actions[step], logprobs[step] = value, action, logprob
            o, r, term, trunc, _ = envs.step(action.numpy())
            done = np.logical_or(term, trunc)
            rewards[step] = torch.tensor(r, dtype=torch.float32)
            next_obs, next_done = torch.tensor(o), torch.tensor(done, dtype=torch.float32)
            ep_ret += r
            for i in np.flatnonzero(done):
                recent = (recent + [ep_ret[i]])[-100:]
                ep_ret[i] = 0.0
            if len(recent) == 100 and np.mean(recent) >= ours.CartPole.reward_threshold:
                envs.close()
                return {"solved_at_seconds": time.perf_counter() - start, "solved_at_step": global_step,
                        "mean_sps": global_step / (time.perf_counter() - start)}  # fmt: skip
        with torch.no_grad():
            next_value = agent.critic(next_obs).squeeze(-1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(num_steps)):
                nextnonterminal = 1.0 - (next_done if t == num_steps - 1 else dones[t + 1])
                nextvalues = next_value if t == num_steps - 1 else values[t + 1]
                delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
            returns = advantages + values
        b_obs, b_actions, b_logprobs = obs.reshape(-1, 4), actions.reshape(-1), logprobs.reshape(-1)
        b_adv, b_returns, b_values = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)
        for _ in range(4):
            perm = np.random.permutation(batch)
            for s in range(0, batch, minibatch):
                mb = perm[s : s + minibatch]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions[mb])
                ratio = (newlogprob - b_logprobs[mb]).exp()
                adv = (b_adv[mb] - b_adv[mb].mean()) / (b_adv[mb].std() + 1e-8)
                pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean()
                v_clipped = b_values[mb] + (newvalue - b_values[mb]).clamp(-clip, clip)
                v_loss = 0.5 * torch.max((newvalue - b_returns[mb]) ** 2, (v_clipped - b_returns[mb]) ** 2).mean()
                loss = pg_loss - ent_coef * entropy.mean() + vf_coef * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), max_grad)
                optimizer.step()
        if global_step >= max_steps:
            break
    envs.close()
    return {"solved_at_seconds": None, "solved_at_step": None, "mean_sps": global_step / (time.perf_counter() - start)}


# ----------------------------------------------------------------------------------------------
# 4. eager vs --compile vs the PureJaxRL-style JAX peer (benchmarks/jax_ppo_cartpole.py)
# ----------------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_GRAPHS = "--compile, CUDA graphs"


def peer_modes(device: str) -> tuple[str, ...]:
    """The rows' columns: on a GPU also --compile with inductor's CUDA graphs (TORCHINDUCTOR_CUDAGRAPHS=1, what
    mode="reduce-overhead" turns on), which replays each compiled phase's kernels in one launch."""
    return ("eager", "--compile") + ((CUDA_GRAPHS,) if device.startswith("cuda") else ()) + ("JAX peer",)


def peer_command(mode: str, n: int, seed: int, iterations: int | None, device: str) -> list[str]:
    """The command line of one run: time-to-solve (stop at the 475 threshold) or `iterations` iterations."""
    common = ["--num-envs", str(n), "--seed", str(seed)]
    if mode == "JAX peer":
        limit = ["--target-return", "475"] if iterations is None else ["--total-timesteps", str(n * 16 * iterations),
                                                                        "--target-return", "inf"]  # fmt: skip
        return [sys.executable, os.path.join(ROOT, "benchmarks", "jax_ppo_cartpole.py"), *common, *limit]
    limit = ["--target-return", "475"] if iterations is None else ["--total-timesteps", str(n * 16 * iterations),
                                                                    "--target-return", "None"]  # fmt: skip
    flags = ["--no-progress-bar", "--eval-episodes", "0", "--device", device] + (
        ["--compile"] if "compile" in mode else []
    )
    return [sys.executable, os.path.join(ROOT, "ppo_cartpole_gpu.py"), *common, *limit, *flags]


def peer_run(mode: str, n: int, seed: int, device: str, iterations: int | None = None) -> dict:
    """One run as a fresh process with cold compilation caches (a user's first run); returns its SPS
    (after compilation), training-loop seconds to solve, and the whole process's seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"))
        if mode == CUDA_GRAPHS:
            env["TORCHINDUCTOR_CUDAGRAPHS"] = "1"
        start = time.perf_counter()
        run = subprocess.run(peer_command(mode, n, seed, iterations, device), cwd=tmp, env=env, capture_output=True,
                             text=True)  # fmt: skip
        if run.returncode != 0:  # a row of its own, not the end of the benchmark
            print(f"{mode}, {n} envs, seed {seed}: exit {run.returncode}\n{run.stderr[-2000:]}", file=sys.stderr)
            return {"sps": float("nan"), "solved_at_seconds": None, "solved_at_step": None, "process_seconds": None}
        out = run.stdout
        process = time.perf_counter() - start
        if mode == "JAX peer":
            result = json.loads(out.strip().splitlines()[-1])
        else:
            (path,) = glob.glob(os.path.join(tmp, "runs", "*", "summary.json"))
            result = json.load(open(path))
    return {"sps": result["mean_sps"], "solved_at_seconds": result["solved_at_seconds"],
            "solved_at_step": result["solved_at_step"], "process_seconds": process}  # fmt: skip


def peer_rows(bench: BenchArgs) -> list[tuple]:
    rows, modes = [], peer_modes(bench.device)
    compiled = [m for m in modes if "compile" in m]
    for n in bench.peer_sizes:
        iterations = 60 if n <= 512 else 15
        # a run per seed: the mean and range of their SPS, the ratio of the means
        sps = {
            mode: [peer_run(mode, n, seed, bench.device, iterations)["sps"] for seed in bench.peer_seeds]
            for mode in modes
        }
        ratio = " / ".join(f"{statistics.mean(sps[m]) / statistics.mean(sps['JAX peer']):.2f}x" for m in compiled)
        seeds = ",".join(map(str, bench.peer_seeds))
        sps_label = f"training SPS after compilation, {n}x16 ({iterations} iterations), seeds {seeds}"
        rows.append((sps_label, *(spread(sps[m], ",.0f") for m in modes), ratio))
        progress(rows[-1])
        if n > bench.solve_up_to:
            continue
        solved = {mode: [peer_run(mode, n, seed, bench.device) for seed in bench.peer_seeds] for mode in modes}
        for key, label in (("solved_at_seconds", "training loop"), ("process_seconds", "whole process")):
            means = {m: [r[key] if r["solved_at_step"] is not None else None for r in solved[m]] for m in modes}
            ok = all(None not in v for v in means.values())
            ratio = " / ".join(f"{statistics.mean(means['JAX peer']) / statistics.mean(means[m]):.2f}x"
                               for m in compiled) if ok else ""  # fmt: skip
            rows.append((f"time-to-solve (475), {label}, s, {n}x16, seeds {seeds}",
                         *(spread(means[m], ".1f") for m in modes), ratio))  # fmt: skip
            progress(rows[-1])
    return rows


# ----------------------------------------------------------------------------------------------
# 5. a busy machine: training speed alone and beside one CPU-bound program (a "hog"), with the thread
# defaults of before (one thread per core, OpenMP threads spinning while idle) and of now (one thread below
# 1024 envs; OMP_WAIT_POLICY=PASSIVE set by the scripts)
# ----------------------------------------------------------------------------------------------
BUSY_WORKLOADS = (
    ("ppo_cartpole_gpu.py", ["--total-timesteps", "204800"]),
    ("vpg.py", ["--total-timesteps", "307200"]),
    ("reinforce.py", ["--total-timesteps", "320000"]),
    ("ppo_cartpole_gpu.py", ["--num-envs", "4096", "--total-timesteps", "1048576"]),
)


@contextmanager
def cpu_hogs(count: int, seconds: float = 600.0):
    """`count` processes that keep one core each busy, for at most `seconds` (killed on leaving)."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass"
    hogs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]
    try:
        time.sleep(0.3)
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def script_sps(script: str, flags: list[str], env: dict) -> float:
    """Training SPS of one whole-process run of `script` with `flags` (fixed steps, no target, no evaluation)."""
    command = [sys.executable, os.path.join(ROOT, script), *flags, "--target-return", "None", "--no-progress-bar",
               "--eval-episodes", "0"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, check=True, timeout=900)
        (path,) = glob.glob(os.path.join(tmp, "runs", "*", "summary.json"))
        return json.load(open(path))["mean_sps"]


def busy_rows(hogs: int) -> list[tuple]:
    quiet_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    setups = {"before": (dict(quiet_env, OMP_WAIT_POLICY="ACTIVE"), ["--torch-threads", str(cores())]),
              "now": (quiet_env, [])}  # fmt: skip
    rows = []
    for script, flags in BUSY_WORKLOADS:
        sps = {}
        for name, (env, threads) in setups.items():
            sps[name, "quiet"] = script_sps(script, flags + threads, env)
            with cpu_hogs(hogs):
                sps[name, "busy"] = script_sps(script, flags + threads, env)
        rows.append((f"`{script} {' '.join(flags)}`", *(f"{sps[k]:,.0f}" for k in sps),
                     f"{sps['before', 'quiet'] / sps['before', 'busy']:.2f}x",
                     f"{sps['now', 'quiet'] / sps['now', 'busy']:.2f}x",
                     f"{sps['now', 'quiet'] / sps['before', 'quiet']:.2f}x"))  # fmt: skip
        progress(rows[-1])
    return rows


# ----------------------------------------------------------------------------------------------
def progress(row: tuple) -> None:
    """One finished row on stderr while the benchmark runs (the tables come at the end, on stdout)."""
    print("  " + " | ".join(str(cell) for cell in row), file=sys.stderr, flush=True)


def spread(values: list[float], fmt: str) -> str:
    """'mean (min–max)' of the solved runs, and how many did not solve."""
    solved = [v for v in values if v is not None]
    if not solved:
        return "not solved"
    text = format(statistics.mean(solved), fmt)
    if len(solved) > 1:
        text += f" ({format(min(solved), fmt)}–{format(max(solved), fmt)})"
    if len(solved) < len(values):
        text += f", {len(values) - len(solved)} unsolved"
    return text


def parse_seeds(text: str) -> list[int]:
    """'1-10' -> [1, ..., 10]; '1,4,7' -> [1, 4, 7]."""
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(seed) for seed in text.split(",")]


def solve_stats(results: list[dict]) -> tuple[str, str, str]:
    """'k/n' solved, and the median (min–max) training seconds and env steps of the solved runs."""
    solved = [r for r in results if r["solved_at_step"] is not None]
    if not solved:
        return f"0/{len(results)}", "", ""

    def median_range(key: str, fmt: str) -> str:
        values = [r[key] for r in solved]
        return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"

    return (
        f"{len(solved)}/{len(results)}",
        median_range("solved_at_seconds", ".2f"),
        median_range("solved_at_step", ",.0f"),
    )


def main() -> None:
    bench = tyro.cli(BenchArgs)
    device = torch.device(bench.device)
    torch.set_num_threads(cores())
    rows, env_rows = [], []
    for n in bench.env_sizes:
        r_ours, r_compiled, r_ref = env_rates(n, device, bench.seconds_per_measure)
        env_rows.append((f"env steps/s, random actions, N={n} ({device.type})", f"{r_ours:,.0f}", f"{r_compiled:,.0f}",
                         f"{r_ref:,.0f}", f"{r_ours / r_ref:.2f}x / {r_compiled / r_ref:.2f}x"))  # fmt: skip
        progress(env_rows[-1])
    peer = [] if bench.skip_peer else peer_rows(bench)
    busy = [] if bench.skip_busy else busy_rows(hogs=1)

    shutil.rmtree(os.path.join(bench.logdir, "runs"), ignore_errors=True)
    os.makedirs(bench.logdir, exist_ok=True)

    seeds = parse_seeds(bench.seeds)
    base = [] if bench.skip_baseline else [cleanrl_baseline(seed, bench.baseline_max_steps) for seed in seeds]
    if base:
        rows.append(("CleanRL-style baseline (4 gymnasium envs x 128 steps)", *solve_stats(base), ""))
        progress(rows[-1])
    for module in (reinforce, vpg, ours):
        results = [run_script(module, bench.logdir, seed=seed, device=bench.device) for seed in seeds]
        secs, base_secs = [r["solved_at_seconds"] for r in results], [b["solved_at_seconds"] for b in base]
        ratio = ""
        if base and None not in secs + base_secs:
            ratio = f"{statistics.median(base_secs) / statistics.median(secs):.1f}x"
        rows.append((f"{module.__name__}.py (defaults)", *solve_stats(results), ratio))
        progress(rows[-1])

    print(f"\n`python {' '.join(sys.argv)}` on {machine(gym, jax)}\n")
    print_table(["measure", "ours, eager", "ours, --compile", "gymnasium", "ratio (eager / compiled)"], env_rows)
    if peer:
        modes = peer_modes(bench.device)
        print_table(["ppo_cartpole_gpu.py vs the JAX peer", *modes, " / ".join(m for m in modes if "compile" in m)
                     + " vs JAX"], peer)  # fmt: skip
    if busy:
        busy_header = [
            f"training SPS, quiet vs beside 1 CPU hog ({cores()} cores)",
            "before: quiet",
            "before: busy",
            "now: quiet",
            "now: busy",
            "slowdown, before",
            "slowdown, now",
            "now / before, quiet",
        ]
        print_table(busy_header, busy)
    print_table([f"time-to-solve (475), seeds {bench.seeds}", "solved", "training seconds: median (min–max)",
                 "env steps: median (min–max)", "CleanRL-style seconds / ours (medians)"], rows)  # fmt: skip


def print_table(header: list[str], rows: list[tuple]) -> None:
    """A markdown table, after a blank line."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
