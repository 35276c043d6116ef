"""Learning benchmark: ppo_mujoco_brax.py (torch policy) vs Brax's own PPO (`brax.training.agents.ppo`),
same env, backend, env steps, batch, hyperparameters and network sizes, several seeds each. Prints one
markdown table (the final mean-action evaluation return: mean and min over the seeds) with the command and
the machine, and draws the learning curves into a PNG. No timings (benchmarks/brax_ppo.py measures speed), so
the two trainers may run side by side, one per core (below).

    python benchmarks/brax_learning.py                       # 4 envs x 2 seeds x 2 trainers (about 1 h, 2-core CPU)
    python benchmarks/brax_learning.py --envs inverted_pendulum --seeds 1 2 3
    python benchmarks/brax_learning.py --skip-ours & python benchmarks/brax_learning.py --skip-brax; \
        python benchmarks/brax_learning.py --reuse                 # both at once, then the table and PNG
    python benchmarks/brax_learning.py --out docs/brax_learning_curves.png    # replace README's figure
    python benchmarks/brax_learning.py --norm-obs on --logdir benchmarks/logs/brax_norm   # both normalising

Both trainers evaluate the final policy the same way: `eval-episodes` fresh episodes with the mean action.
What cannot be matched: Brax's PPO has no running reward normalisation (ours: --norm-reward; Brax gets
reward_scaling=1) and no linear learning-rate annealing (ours anneals to 0; Brax keeps it constant).
Truncation: ours bootstraps from the final observation; Brax's PPO leaves truncated steps out of its loss
(its `bootstrap_on_timeout` needs an env-set `info["time_out"]`, which most envs lack and inverted_pendulum
sets on every termination, pole falls included). Everything else maps one to one (see `brax_ppo_kwargs`),
observation normalisation included (our --norm-obs auto: off on the pendulums and hopper). Our runs are
separate processes with the script's own thread choice unless --torch-threads; their TensorBoard logs stay
under `--logdir`.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import tyro  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ppo_mujoco_brax as ours  # noqa: E402
from common import machine  # noqa: E402

jax, brax_envs = ours.import_brax()  # not `import jax`: the helper first sets the environment variables JAX reads

# env -> (parallel envs, env steps): the pendulums learn in few steps, so they get smaller batches
SETTINGS = {
    "inverted_pendulum": (256, 1_000_000),
    "inverted_double_pendulum": (256, 2_000_000),
    "hopper": (2048, 3_000_000),
    "halfcheetah": (2048, 3_000_000),
}


@dataclass
class BenchArgs:
    envs: list[str] = field(default_factory=lambda: list(SETTINGS))
    """the Brax envs to train on (each with its own number of envs and steps, see SETTINGS)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    """seeds per env and trainer"""
    backend: str = "spring"
    """the Brax pipeline for both trainers"""
    eval_episodes: int = 16
    """mean-action episodes that score each trained policy"""
    curve_points: int = 10
    """Brax's PPO evaluations along the run (its learning curve)"""
    logdir: str = "benchmarks/logs/brax"
    """our runs' folders and Brax's curves (JSON) go here"""
    out: str = "benchmarks/logs/brax_learning_curves.png"
    """the curves PNG (README's figure lives in docs/: write there on purpose only)"""
    norm_obs: ours.NormObs = "auto"
    """observation normalisation for both trainers (ours: --norm-obs; Brax's: normalize_observations);
    auto: as our default, per env"""
    torch_threads: int = 0
    """our runs' --torch-threads (0: the script's choice, one thread below 1024 envs and every core from
    there; 1 lets two of these benchmarks share two cores)"""
    skip_ours: bool = False
    """train no ppo_mujoco_brax.py runs (with --reuse, saved ones still count)"""
    skip_brax: bool = False
    """train no Brax PPO runs (with --reuse, saved ones still count)"""
    reuse: bool = False
    """take each run's result from `logdir` where a finished one is there, and train only the missing ones;
    with both --skip flags: the table and PNG of what is saved"""


def our_runs(env_id: str, seed: int, bench: BenchArgs) -> list[str]:
    """summary.json of every ppo_mujoco_brax.py run for (env, seed) in `logdir`, oldest first (the run
    folders end in their start time)."""
    return sorted(
        glob.glob(os.path.join(bench.logdir, "runs", f"{env_id}__ppo_mujoco_brax__{seed}__*", "summary.json"))
    )


def brax_result(env_id: str, seed: int, bench: BenchArgs) -> str:
    """Where Brax's PPO result for (env, seed) is saved."""
    return os.path.join(bench.logdir, f"brax_ppo__{env_id}__{seed}.json")


def saved(name: str, env_id: str, seed: int, bench: BenchArgs) -> dict | None:
    """The newest saved result of trainer `name` for (env, seed), or None."""
    if name == "ours":
        for path in reversed(our_runs(env_id, seed, bench)):
            with open(path) as f:
                summary = json.load(f)
            if summary["status"] == "completed":  # not a run stopped early (Ctrl-C, SIGTERM)
                return summary | {"run": os.path.dirname(path)}
        return None
    path = brax_result(env_id, seed, bench)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def run_ours(env_id: str, seed: int, bench: BenchArgs) -> dict:
    """ppo_mujoco_brax.py on its defaults in a fresh process; returns its summary.json."""
    num_envs, steps = SETTINGS[env_id]
    cmd = [sys.executable, os.path.join(ROOT, "ppo_mujoco_brax.py"), "--env-id", env_id, "--backend", bench.backend,
           "--num-envs", str(num_envs), "--total-timesteps", str(steps), "--seed", str(seed),
           "--eval-episodes", str(bench.eval_episodes), "--torch-threads", str(bench.torch_threads),
           "--norm-obs", bench.norm_obs, "--no-progress-bar"]  # fmt: skip
    subprocess.run(cmd, cwd=bench.logdir, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return saved("ours", env_id, seed, bench)


def brax_ppo_kwargs(env_id: str, seed: int, bench: BenchArgs) -> dict:
    """Brax's PPO with our defaults (ours.Args) where the two have the same knob."""
    a, (num_envs, steps) = ours.Args(env_id=env_id, norm_obs=bench.norm_obs), SETTINGS[env_id]
    from brax.training.agents.ppo import networks as ppo_networks

    return dict(
        num_timesteps=steps, num_envs=num_envs, episode_length=a.episode_length, unroll_length=a.num_steps,
        batch_size=num_envs // a.num_minibatches, num_minibatches=a.num_minibatches,  # num_envs*T/minibatches rows
        num_updates_per_batch=a.update_epochs, learning_rate=a.learning_rate, entropy_cost=a.ent_coef,
        discounting=a.gamma, gae_lambda=a.gae_lambda, clipping_epsilon=a.clip_coef, max_grad_norm=a.max_grad_norm,
        vf_loss_coefficient=a.vf_coef, normalize_advantage=a.norm_adv, normalize_observations=ours.normalises_obs(a),
        bootstrap_on_timeout=False, reward_scaling=1.0, seed=seed, num_evals=bench.curve_points + 1,
        num_eval_envs=bench.eval_episodes, deterministic_eval=True,
        network_factory=functools.partial(ppo_networks.make_ppo_networks, policy_hidden_layer_sizes=(64, 64),
                                          value_hidden_layer_sizes=(64, 64)),
    )  # fmt: skip


def run_brax(env_id: str, seed: int, bench: BenchArgs) -> dict:
    """Brax's PPO in this process; returns its final evaluation and curve, also saved as JSON in `logdir`."""
    from brax.training.agents.ppo import train as ppo

    curve = []
    ppo.train(environment=brax_envs.get_environment(env_id, backend=bench.backend),
              progress_fn=lambda step, metrics: curve.append((int(step), float(metrics["eval/episode_reward"]))),
              **brax_ppo_kwargs(env_id, seed, bench))  # fmt: skip
    result = {"eval_mean_return": curve[-1][1], "curve": curve}
    with open(brax_result(env_id, seed, bench), "w") as f:
        json.dump(result, f)
    return result


def our_curve(run: str) -> tuple[list[int], list[float]]:
    acc = EventAccumulator(run, size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars("charts/episodic_return")
    return [e.step for e in events], [e.value for e in events]


def plot(results: dict, bench: BenchArgs) -> None:
    """One panel per env: our training episodes' returns (sampled actions, thin) and both trainers' final
    mean-action evaluations (markers), with Brax's evaluations along its run (dashed)."""
    fig, axes = plt.subplots(1, len(bench.envs), figsize=(4.5 * len(bench.envs), 3.6), squeeze=False)
    for ax, env_id in zip(axes[0], bench.envs):
        for seed in bench.seeds:
            if "ours" not in results[env_id, seed]:
                continue
            mine = results[env_id, seed]["ours"]
            steps, values = our_curve(mine["run"])
            ax.plot(steps, values, color="tab:blue", lw=0.8, alpha=0.6,
                    label="ours: training episodes" if seed == bench.seeds[0] else None)  # fmt: skip
            ax.plot(mine["total_env_steps"], mine["eval_mean_return"], "o", color="tab:blue",
                    label="ours: final mean-action eval" if seed == bench.seeds[0] else None)  # fmt: skip
        for seed in bench.seeds:
            if "brax" in results[env_id, seed]:
                curve = results[env_id, seed]["brax"]["curve"]
                ax.plot(*zip(*curve), "--s", color="tab:orange", ms=3,
                        label="Brax PPO: mean-action evals" if seed == bench.seeds[0] else None)  # fmt: skip
        ax.set_title(f"{env_id} ({SETTINGS[env_id][0]} envs)")
        ax.set_xlabel("env steps")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("episode return")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"ppo_mujoco_brax.py vs Brax's PPO, {bench.backend} backend, seeds {bench.seeds}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(bench.out)), exist_ok=True)
    fig.savefig(bench.out, dpi=110)


def main() -> None:
    bench = tyro.cli(BenchArgs)
    unknown = set(bench.envs) - set(SETTINGS)
    if unknown:
        print(f"error: no settings for {sorted(unknown)}; choose from {sorted(SETTINGS)}", file=sys.stderr)
        raise SystemExit(2)
    os.makedirs(bench.logdir, exist_ok=True)
    trainers = {"ours": run_ours, "brax": run_brax}
    results = {}
    for env_id in bench.envs:
        for seed in bench.seeds:
            results[env_id, seed] = {}
            for name, run in trainers.items():
                result = saved(name, env_id, seed, bench) if bench.reuse else None
                if result is None and not getattr(bench, f"skip_{name}"):
                    result = run(env_id, seed, bench)
                if result is not None:
                    results[env_id, seed][name] = result
                    print(f"{env_id} seed {seed}: {name} {result['eval_mean_return']:.1f}", flush=True)
    plot(results, bench)
    print(f"\n`python {' '.join(sys.argv)}` on {machine(jax)}; {bench.backend} backend, our defaults for both "
          f"trainers (see the docstring), final return = mean of {bench.eval_episodes} mean-action episodes; "
          f"curves: {bench.out}\n")  # fmt: skip
    print("| env | envs x steps | ours: mean (min) | Brax PPO: mean (min) | ours - Brax (means) |")
    print("|---|---|---|---|---|")
    for env_id in bench.envs:
        cells = {}
        for name in trainers:
            returns = [results[env_id, s][name]["eval_mean_return"] for s in bench.seeds if name in results[env_id, s]]
            cells[name] = (sum(returns) / len(returns), min(returns)) if returns else None
        text = {name: "-" if c is None else f"{c[0]:.1f} ({c[1]:.1f})" for name, c in cells.items()}
        counts = {name: sum(name in results[env_id, s] for s in bench.seeds) for name in trainers}
        if min(counts.values()) < len(bench.seeds):  # say so where some seeds are missing
            text = {name: f"{t}, {counts[name]} seed{'s' * (counts[name] != 1)}" for name, t in text.items()}
        gap = "-" if None in cells.values() else f"{cells['ours'][0] - cells['brax'][0]:+.1f}"
        num_envs, steps = SETTINGS[env_id]
        print(f"| {env_id} | {num_envs} x {steps / 1e6:g}M | {text['ours']} | {text['brax']} | {gap} |")


if __name__ == "__main__":
    main()
