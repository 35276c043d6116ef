"""The JAX peer of ppo_cartpole_gpu.py: PPO in the PureJaxRL style, the whole iteration in one `jax.jit`.

Written for the benchmark (benchmarks/cartpole.py), as a JAX user would write it: a CartPole in jnp with
gymnasium's CartPole-v1 physics (the same as ours: explicit Euler, 500-step truncation, auto-reset,
the real last observation kept so truncated episodes are bootstrapped), and PPO with exactly
ppo_cartpole_gpu.py's defaults: 64-64 tanh actor and critic with orthogonal init, 128 envs x 16 steps,
GAE(0.99, 0.95), 4 epochs of 4 shuffled minibatches, per-minibatch advantage normalisation, clip 0.2,
unclipped value loss (coefficient 0.5), no entropy bonus, global grad-norm 0.5, Adam(eps 1e-5) with the
learning rate 5e-3 annealed linearly per iteration.

One jitted function runs an iteration (rollout `lax.scan`, GAE reverse `lax.scan`, epochs and
minibatches as nested `lax.scan`s); a Python loop calls it and reads the finished episodes back once
per iteration, as our script does, to keep the 100-episode mean. As with `--compile`, iteration 1
(compilation) is left out of SPS and of the time to solve.

    python benchmarks/jax_ppo_cartpole.py --num-envs 128 --seed 1     # prints a JSON summary
    python benchmarks/jax_ppo_cartpole.py --num-seeds 16              # seeds 1-16 vmapped in one program
    python benchmarks/jax_ppo_cartpole.py --num-seeds 4 --learning-rates 1e-3,3e-3   # 2 rates x 4 seeds, vmapped
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
import optax

GRAVITY, MASSCART, MASSPOLE, LENGTH, FORCE_MAG, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
TOTAL_MASS, POLEMASS_LENGTH = MASSCART + MASSPOLE, MASSPOLE * LENGTH
X_THRESHOLD, THETA_THRESHOLD, MAX_STEPS = 2.4, 12 * 2 * math.pi / 360, 500


def env_step(state, length, ret, action, key):
    """One step of N CartPoles (gymnasium's equations); finished envs restart from fresh states."""
    x, x_dot, theta, theta_dot = state.T
    force = jnp.where(action == 1, FORCE_MAG, -FORCE_MAG)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    temp = (force + POLEMASS_LENGTH * theta_dot**2 * sin) / TOTAL_MASS
    thetaacc = (GRAVITY * sin - cos * temp) / (LENGTH * (4.0 / 3.0 - MASSPOLE * cos**2 / TOTAL_MASS))
    xacc = temp - POLEMASS_LENGTH * thetaacc * cos / TOTAL_MASS
    new = jnp.stack([x + TAU * x_dot, x_dot + TAU * xacc, theta + TAU * theta_dot, theta_dot + TAU * thetaacc], 1)
    terminated = (jnp.abs(new[:, 0]) > X_THRESHOLD) | (jnp.abs(new[:, 2]) > THETA_THRESHOLD)
    ret, length = ret + 1.0, length + 1
    done = terminated | (length >= MAX_STEPS)
    fresh = jax.random.uniform(key, new.shape, minval=-0.05, maxval=0.05)
    next_state = jnp.where(done[:, None], fresh, new)
    out = dict(reward=jnp.ones_like(ret), terminated=terminated, done=done, final_obs=new, ep_return=ret)
    return next_state, jnp.where(done, 0, length), jnp.where(done, 0.0, ret), out


def mlp_init(key, sizes, out_scale):
    keys = jax.random.split(key, len(sizes) - 1)
    scales = [math.sqrt(2)] * (len(sizes) - 2) + [out_scale]
    return [(jax.nn.initializers.orthogonal(s)(k, (i, o)), jnp.zeros(o)) for k, i, o, s in
            zip(keys, sizes[:-1], sizes[1:], scales)]  # fmt: skip


def mlp(params, x):
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def train(num_envs=128, num_steps=16, seed=1, total_timesteps=5_000_000, target_return=500.0, solved_threshold=475.0,
          learning_rate=5e-3, num_minibatches=4, update_epochs=4, gamma=0.99, gae_lambda=0.95, clip_coef=0.2,
          vf_coef=0.5, max_grad_norm=0.5, num_seeds=1, learning_rates=None) -> dict:  # fmt: skip
    """One seed as written; with num_seeds K > 1 the same iteration `jax.vmap`ped over K agents and their envs
    (seeds seed..seed+K-1, PureJaxRL's headline), stopping once every seed reached the target. `learning_rates`: a
    sweep, K seeds of each rate, all vmapped (the rate a vmapped input, as the seed is)."""
    batch_size = num_envs * num_steps
    num_iterations = total_timesteps // batch_size
    steps_per_iteration = num_minibatches * update_epochs
    # optax.adam(schedule) with the rate of the carry: Adam's direction, then the annealed rate (optax's own count)
    tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.scale_by_adam(eps=1e-5))
    frac = lambda count: 1.0 - (count // steps_per_iteration) / num_iterations  # noqa: E731

    def init(seed, lr):
        key, k_actor, k_critic, k_env = jax.random.split(jax.random.PRNGKey(seed), 4)
        params = {"actor": mlp_init(k_actor, [4, 64, 64, 2], 0.01), "critic": mlp_init(k_critic, [4, 64, 64, 1], 1.0)}
        env = (jax.random.uniform(k_env, (num_envs, 4), minval=-0.05, maxval=0.05), jnp.zeros(num_envs, jnp.int32),
               jnp.zeros(num_envs))  # fmt: skip
        return params, tx.init(params), env, key, lr

    def loss_fn(params, obs, actions, old_logp, adv, returns):
        logp = jax.nn.log_softmax(mlp(params["actor"], obs))
        logp = jnp.take_along_axis(logp, actions[:, None], 1)[:, 0]
        ratio = jnp.exp(logp - old_logp)
        adv = (adv - adv.mean()) / (adv.std(ddof=1) + 1e-8)
        pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
        value = mlp(params["critic"], obs)[:, 0]
        return pg + vf_coef * 0.5 * ((value - returns) ** 2).mean()

    def iteration(carry):
        params, opt_state, env, key, lr = carry

        def step(c, _):
            env, key = c
            key, k_act, k_reset = jax.random.split(key, 3)
            obs = env[0]
            action = jax.random.categorical(k_act, mlp(params["actor"], obs))
            *env, out = env_step(*env, action, k_reset)
            return (tuple(env), key), dict(out, obs=obs, action=action)

        (env, key), r = jax.lax.scan(step, (env, key), None, num_steps)
        logp_all = jax.nn.log_softmax(mlp(params["actor"], r["obs"]))
        old_logp = jnp.take_along_axis(logp_all, r["action"][..., None], -1)[..., 0]
        values = mlp(params["critic"], r["obs"])[..., 0]
        next_values = mlp(params["critic"], r["final_obs"])[..., 0]
        deltas = r["reward"] + gamma * next_values * (1.0 - r["terminated"]) - values
        decay = gamma * gae_lambda * (1.0 - r["done"])

        def gae_step(last, x):
            last = x[0] + x[1] * last
            return last, last

        _, adv = jax.lax.scan(gae_step, jnp.zeros(num_envs), (deltas, decay), reverse=True)
        flat = jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]),
                            (r["obs"], r["action"], old_logp, adv, adv + values))  # fmt: skip

        def epoch(c, k):
            def minibatch(c, mb):
                params, opt_state = c
                grads, rate = jax.grad(loss_fn)(params, *mb), lr * frac(opt_state[1].count)
                updates, opt_state = tx.update(grads, opt_state, params)
                return (optax.apply_updates(params, jax.tree.map(lambda u: -rate * u, updates)), opt_state), None

            perm = jax.random.permutation(k, batch_size)
            mbs = jax.tree.map(lambda x: x[perm].reshape(num_minibatches, -1, *x.shape[1:]), flat)
            return jax.lax.scan(minibatch, c, mbs)[0], None

        key, k_perm = jax.random.split(key)
        (params, opt_state), _ = jax.lax.scan(epoch, (params, opt_state), jax.random.split(k_perm, update_epochs))
        return (params, opt_state, env, key, lr), (r["done"], r["ep_return"])

    rates = learning_rates or [learning_rate]
    seeds = jnp.array([s for _ in rates for s in range(seed, seed + num_seeds)])
    lrs, num_seeds = jnp.array([lr for lr in rates for _ in range(num_seeds)]), num_seeds * len(rates)
    if num_seeds == 1:  # the code as written, for one seed
        carry, run = init(seed, learning_rate), jax.jit(iteration, donate_argnums=(0,))
        one_host_read = lambda outs: [jax.device_get(outs)]  # noqa: E731
    else:  # K seeds: a leading axis on everything, one program for all
        carry, run = jax.vmap(init)(seeds, lrs), jax.jit(jax.vmap(iteration), donate_argnums=(0,))
        one_host_read = lambda outs: list(zip(*jax.device_get(outs)))  # noqa: E731
    recent = [deque(maxlen=100) for _ in range(num_seeds)]
    solved_step, solved_seconds, reached = [None] * num_seeds, [None] * num_seeds, [False] * num_seeds
    steps, start = 0, time.perf_counter()
    for i in range(1, num_iterations + 1):
        carry, outs = run(carry)
        for k, (done, ep_return) in enumerate(one_host_read(outs)):  # the iteration's one host read
            recent[k].extend(ep_return[done].tolist())
        steps += batch_size
        if i == 1:  # compiled and ran once: the clock starts now, as with --compile
            clock, counted = time.perf_counter(), 0
            compile_seconds = round(clock - start, 2)
            continue
        counted += batch_size
        for k in range(num_seeds):
            mean = float(np.mean(recent[k])) if len(recent[k]) == recent[k].maxlen else -math.inf
            if solved_step[k] is None and mean >= solved_threshold:
                solved_step[k], solved_seconds[k] = steps, time.perf_counter() - clock
            reached[k] = reached[k] or mean >= target_return
        if all(reached):
            break
    wall = time.perf_counter() - clock
    one = (lambda x: x[0]) if num_seeds == 1 else (lambda x: x)  # noqa: E731
    return {"mean_sps": round(num_seeds * counted / wall, 1), "wall_seconds": round(wall, 3),
            "total_env_steps": num_seeds * steps, "iterations": i, "solved_at_step": one(solved_step),
            "solved_at_seconds": one(solved_seconds),
            "mean_return_last_100": one([float(np.mean(r)) if r else None for r in recent]),
            "compile_seconds": compile_seconds, "device": str(jax.devices()[0]), "num_seeds": num_seeds}  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-envs", type=int, default=128)
    parser.add_argument("--num-steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--total-timesteps", type=int, default=5_000_000)
    parser.add_argument("--target-return", type=float, default=500.0, help="stop at this 100-episode mean (inf: never)")
    parser.add_argument("--num-seeds", type=int, default=1, help="seeds --seed.. in one vmapped program")
    parser.add_argument("--num-minibatches", type=int, default=4)
    parser.add_argument("--learning-rates", type=lambda v: [float(x) for x in v.split(",")], default=None,
                        help="a sweep: --num-seeds seeds of each rate (e.g. 1e-3,5e-3), all vmapped")  # fmt: skip
    a = parser.parse_args()
    print(json.dumps(train(a.num_envs, a.num_steps, a.seed, a.total_timesteps, a.target_return,
                           num_minibatches=a.num_minibatches, num_seeds=a.num_seeds,
                           learning_rates=a.learning_rates)))  # fmt: skip
