"""Brax benchmark: our wrapper's overhead over the raw jitted step, and PPO training speed of
ppo_mujoco_brax.py (torch policy) vs Brax's own JAX PPO (`brax.training.agents.ppo`), side by side
in one run on the same env, backend and batch. Prints one markdown table with the command and machine.

    python benchmarks/brax_ppo.py                                   # ant, spring, 2048 envs
    python benchmarks/brax_ppo.py --env-id inverted_pendulum --iterations 10
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_mujoco_brax as ours  # noqa: E402
from common import cores, machine, train_and_summarize  # noqa: E402

jax, brax_envs = ours.import_brax()  # not `import jax`: the helper first sets the environment variables JAX reads


@dataclass
class BenchArgs:
    env_id: str = "ant"
    """the Brax env"""
    backend: str = "spring"
    """the Brax pipeline"""
    num_envs: int = 2048
    """parallel envs, for every row"""
    num_steps: int = 10
    """unroll length per PPO iteration"""
    num_minibatches: int = 32
    """minibatches per epoch (both trainers)"""
    iterations: int = 10
    """PPO iterations per trainer (after compilation; fewer make the --compile row noisy)"""
    env_steps: int = 30
    """batched steps per env-rate measurement"""


def env_rates(bench: BenchArgs) -> tuple[float, float]:
    """Env steps/s of the raw jit(vmap(step)) and of our BraxVecEnv (auto-reset, episode stats, DLPack)."""
    env = brax_envs.get_environment(bench.env_id, backend=bench.backend)
    reset, step = jax.jit(jax.vmap(env.reset)), jax.jit(jax.vmap(env.step))
    state = reset(jax.random.split(jax.random.PRNGKey(0), bench.num_envs))
    action = jax.numpy.zeros((bench.num_envs, env.action_size))
    state = step(step(state, action), action)  # twice: the first call's uncommitted inputs compile their own version
    jax.block_until_ready(state.obs)
    t0 = time.perf_counter()
    for _ in range(bench.env_steps):
        state = step(state, action)
    jax.block_until_ready(state.obs)
    raw = bench.env_steps * bench.num_envs / (time.perf_counter() - t0)

    device = ours.Args().device  # the policy's device: the wrapper hands JAX's arrays over there
    wrapped = ours.BraxVecEnv(bench.env_id, bench.backend, bench.num_envs, 1000, device, seed=0)
    wrapped.reset()
    zeros = torch.zeros(bench.num_envs, wrapped.action_dim, device=device)
    wrapped.step(zeros)
    t0 = time.perf_counter()
    for _ in range(bench.env_steps):
        obs = wrapped.step(zeros)[0]
    obs.sum().item()
    return raw, bench.env_steps * bench.num_envs / (time.perf_counter() - t0)


def run_ours(bench: BenchArgs, compile: bool = False) -> float:
    """Training SPS of ppo_mujoco_brax.py; with --compile one more iteration, the first (compilation), which
    its SPS leaves out."""
    steps = bench.num_envs * bench.num_steps * (bench.iterations + compile)
    args = ours.Args(env_id=bench.env_id, backend=bench.backend, num_envs=bench.num_envs, num_steps=bench.num_steps,
                     num_minibatches=bench.num_minibatches, total_timesteps=steps, eval_episodes=0,
                     progress_bar=False, compile=compile)  # fmt: skip
    return train_and_summarize(ours, args)["mean_sps"]


def run_brax_ppo(bench: BenchArgs) -> float:
    """Brax's JAX PPO at the same batch and network size (64-64 policy and value, as ours): each
    update collects num_envs x num_steps env steps and takes 4 epochs of `num_minibatches`
    minibatches. SPS between its second and third progress calls, so the compilation (after the
    first) is left out; each of those spans holds `iterations` updates and one 1-env evaluation."""
    import functools

    from brax.training.agents.ppo import networks as ppo_networks
    from brax.training.agents.ppo import train as ppo

    if not hasattr(jax, "device_put_replicated"):  # removed in JAX 0.10 (Brax 0.14.2 still calls it): its plain meaning
        jax.device_put_replicated = lambda x, devices: jax.tree.map(lambda a: jax.device_put(
            jax.numpy.stack([a] * len(devices)), devices[0]), x)  # fmt: skip
    env = brax_envs.get_environment(bench.env_id, backend=bench.backend)
    calls = []
    steps_per_iter = bench.num_envs * bench.num_steps
    ppo.train(
        environment=env, num_timesteps=steps_per_iter * bench.iterations * 2, num_evals=3, episode_length=1000,
        num_envs=bench.num_envs, unroll_length=bench.num_steps, batch_size=bench.num_envs // bench.num_minibatches,
        num_minibatches=bench.num_minibatches, num_updates_per_batch=4, learning_rate=3e-4, entropy_cost=0.0,
        discounting=0.97, normalize_observations=True, reward_scaling=1.0, clipping_epsilon=0.3, seed=1,
        num_eval_envs=1, progress_fn=lambda step, metrics: calls.append((step, time.perf_counter())),
        network_factory=functools.partial(ppo_networks.make_ppo_networks, policy_hidden_layer_sizes=(64, 64),
                                          value_hidden_layer_sizes=(64, 64)),
    )  # fmt: skip
    (s0, t0), (s1, t1) = calls[1], calls[2]
    return (s1 - s0) / (t1 - t0)


def main() -> None:
    bench = tyro.cli(BenchArgs)
    torch.set_num_threads(cores())  # train() leaves the thread count to its caller
    raw, wrapped = env_rates(bench)
    print(f"env raw {raw:.0f} wrapped {wrapped:.0f}", file=sys.stderr)
    sps_ours = run_ours(bench)
    print(f"ours {sps_ours:.0f}", file=sys.stderr)
    sps_compiled = run_ours(bench, compile=True)
    print(f"ours --compile {sps_compiled:.0f}", file=sys.stderr)
    sps_brax = run_brax_ppo(bench)
    print(f"brax {sps_brax:.0f}", file=sys.stderr)
    print(f"\n`python {' '.join(sys.argv)}` on {machine(jax)} (JAX on {jax.default_backend()}); "
          f"{bench.env_id}/{bench.backend}, {bench.num_envs} envs x {bench.num_steps} steps, "
          f"{bench.num_minibatches} minibatches x 4 epochs\n")  # fmt: skip
    print("| measure | steps/s | ratio |")
    print("|---|---|---|")
    print(f"| raw jit(vmap(env.step)) | {raw:,.0f} | 1.00x |")
    wrapper = "BraxVecEnv.step (fresh-key auto-reset, final obs, episode stats, DLPack)"
    print(f"| {wrapper} | {wrapped:,.0f} | {wrapped / raw:.2f}x |")
    print(f"| Brax's JAX PPO training | {sps_brax:,.0f} | 1.00x |")
    print(f"| ppo_mujoco_brax.py training (torch policy) | {sps_ours:,.0f} | {sps_ours / sps_brax:.2f}x |")
    print(f"| ppo_mujoco_brax.py --compile | {sps_compiled:,.0f} | {sps_compiled / sps_brax:.2f}x |")


if __name__ == "__main__":
    main()
