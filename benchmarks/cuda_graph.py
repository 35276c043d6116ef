"""One CUDA graph per iteration (--cuda-graph) against the loop of phases launched from Python, and the JAX peer.

On a CUDA GPU, for each CartPole script and --num-envs, training SPS after warm-up (summary.json's `mean_sps`: the
first iteration's compilation and the recording are set-up, not counted), each mode in this process, one after the
other, `--iterations` iterations each:
  loop             the phases called from Python every iteration (--no-cuda-graph), as in the CPU path
  graph            the iteration's device work recorded once as a CUDA graph and replayed (--cuda-graph)
  loop-compile, graph-compile    the same with --compile
and the PureJaxRL-style JAX peer (benchmarks/jax_ppo_cartpole.py, PPO only: its iteration is ours) in a subprocess,
at JAX's default matmul precision and at full float32 (`JAX_DEFAULT_MATMUL_PRECISION=highest`). Prints one JSON line
per measurement as it goes, then a Markdown table with the ratios to the loop and to JAX.

    python benchmarks/cuda_graph.py                                            # PPO at 128, 4,096 and 65,536 envs
    python benchmarks/cuda_graph.py --scripts vpg reinforce --sizes 4096 --modes loop graph --no-jax
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import machine, train_and_summarize  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ["loop", "graph", "loop-compile", "graph-compile"]


def measure(script: str, num_envs: int, mode: str, iterations: int, seed: int = 1) -> dict:
    """One training run of `script` at `num_envs` in `mode`, `iterations` iterations (REINFORCE: about as many
    steps as PPO's iterations at 500 steps per rollout), no target, no evaluation."""
    module = __import__(script)
    steps = 500 if script == "reinforce" else 16
    args = module.Args(num_envs=num_envs, num_steps=steps, total_timesteps=num_envs * steps * iterations, seed=seed,
                       target_return=None, eval_episodes=0, progress_bar=False, device="cuda", exp_name=mode,
                       compile=mode.endswith("compile"), cuda_graph=mode.startswith("graph"))  # fmt: skip
    torch._dynamo.reset()
    start = time.perf_counter()
    summary = train_and_summarize(module, args)
    return dict(script=script, num_envs=num_envs, mode=mode, sps=summary["mean_sps"],
                ms_per_iteration=round(1000 * num_envs * steps / summary["mean_sps"], 2),  # REINFORCE: at most
                setup_seconds=summary["setup_seconds"], seconds=round(time.perf_counter() - start, 1),
                mean_return_last_100=summary["mean_return_last_100"])  # fmt: skip


def jax_peer(num_envs: int, iterations: int, precision: str | None) -> dict:
    """benchmarks/jax_ppo_cartpole.py at `num_envs` for `iterations` iterations, in its own process."""
    env = dict(os.environ, **({"JAX_DEFAULT_MATMUL_PRECISION": precision} if precision else {}))
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "jax_ppo_cartpole.py"), "--num-envs", str(num_envs),
               "--total-timesteps", str(num_envs * 16 * iterations), "--target-return", "inf"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode:
        return dict(script="jax", num_envs=num_envs, mode=f"jax-{precision or 'default'}", error=out.stderr[-500:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(
        script="jax",
        num_envs=num_envs,
        mode=f"jax-{precision or 'default'}",
        sps=result["mean_sps"],
        setup_seconds=result["compile_seconds"],
        mean_return_last_100=result["mean_return_last_100"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", nargs="+", default=["ppo_cartpole_gpu"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 4096, 65536])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--iterations", type=int, default=200, help="per run; the first (run as written) is counted")
    parser.add_argument("--no-jax", action="store_true", help="leave out the JAX peer")
    a = parser.parse_args()
    print(f"# {machine()}; {' '.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])}", flush=True)
    rows = []
    for script in a.scripts:
        for num_envs in a.sizes:
            for mode in a.modes:
                try:
                    rows.append(measure(script, num_envs, mode, a.iterations))
                except Exception as e:  # one failed mode is a result too: the rest go on
                    rows.append(dict(script=script, num_envs=num_envs, mode=mode, error=f"{type(e).__name__}: {e}"))
                print(json.dumps(rows[-1]), flush=True)
    for num_envs in [] if a.no_jax else a.sizes:
        for precision in (None, "highest"):
            rows.append(jax_peer(num_envs, a.iterations, precision))
            print(json.dumps(rows[-1]), flush=True)
    jax = {(r["num_envs"], r["mode"]): r.get("sps") for r in rows if r["script"] == "jax"}
    print("\n| script | envs | mode | SPS | ms/iteration | set-up s | x loop | x JAX default | x JAX float32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["script"] == "jax" or "error" in r:
            continue
        loop = next((x.get("sps") for x in rows if (x["script"], x["num_envs"], x["mode"]) == (r["script"],
                     r["num_envs"], "loop")), None)  # fmt: skip
        ratio = lambda other, sps=r["sps"]: f"{sps / other:.2f}" if other else "–"  # noqa: E731
        print(f"| {r['script']} | {r['num_envs']:,} | {r['mode']} | {r['sps']:,.0f} | {r['ms_per_iteration']} | "
              f"{r['setup_seconds']} | {ratio(loop)} | {ratio(jax.get((r['num_envs'], 'jax-default')))} | "
              f"{ratio(jax.get((r['num_envs'], 'jax-highest')))} |")  # fmt: skip
    for (num_envs, mode), sps in jax.items():
        print(f"| jax peer | {num_envs:,} | {mode} | {f'{sps:,.0f}' if sps else 'failed'} | | | | | |")


if __name__ == "__main__":
    main()
