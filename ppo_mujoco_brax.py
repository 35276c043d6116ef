"""PPO for continuous control on Brax physics (JAX), with a torch policy and zero-copy DLPack: Brax steps thousands of
MuJoCo-style robots in jit-compiled JAX; the policy, rollout buffer and update are torch.

The update (Schulman et al. 2017; CleanRL's continuous-action details), with Brax's PPO defaults but CleanRL's γ:
    π_θ(a|s) = N(μ_θ(s), diag(exp(log σ)²)),  log σ a learned state-independent vector
    s normalised by a running mean/std (--norm-obs), r scaled by a running std of the discounted return
    δ_t     = r_t + γ (1 - term_t) V(s'_t) - V(s_t)         s'_t: the real next state, also when
    Â_t     = δ_t + γλ (1 - done_t) Â_{t+1}                       the episode was cut by the time limit
    L_clip  = E[ max(-Â_t ρ_t(θ), -Â_t clip(ρ_t(θ), 1-ε, 1+ε)) ],  ρ_t(θ) = π_θ(a_t|s_t) / π_θold(a_t|s_t)
    L_V     = ½ E[(V_θ(s_t) - R_t)²],  R_t = Â_t + V_old(s_t)      (--clip-vloss: clipped around V_old as in PPO2)
    L       = L_clip - c_ent H[π_θ] + c_vf L_V
"""

from __future__ import annotations

import contextlib
import ctypes.util
import functools
import io
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional, get_args

# OpenMP threads that sleep, not spin, while they wait (4x faster on a busy 2-core machine): set before torch loads it
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from ladder.cli import run_command_line
from ladder.distributed import average_gradients
from ladder.flags import RunFlags
from ladder.optim import Adam
from ladder.run import Run

Locomotion = Literal["ant", "halfcheetah", "hopper", "walker2d", "humanoid"]
EnvId = Literal[Locomotion, "inverted_pendulum", "inverted_double_pendulum", "reacher", "pusher"]
Backend = Literal["spring", "positional", "generalized", "mjx"]
NormObs = Literal["auto", "on", "off"]

THREADED_FROM_ENVS = 1024  # one torch thread below this many envs (docs/running.md: "Threads and a busy machine")


@dataclass(frozen=True)
class Args(RunFlags):
    # The algorithm's flags: a --resume keeps these as the checkpoint has them; after them, run flags' defaults
    env_id: EnvId = "ant"
    """the Brax environment"""
    seed: int = 1
    """seed of the networks, the action sampling and the environments"""
    backend: Backend = "spring"
    """the Brax physics pipeline: spring (fastest), positional, generalized (most accurate) or mjx"""
    episode_length: int = 1000
    """steps after which an episode is truncated"""
    learning_rate: float = 3e-4
    """Adam learning rate"""
    num_envs: int = 2048
    """parallel environments (per process under torchrun)"""
    num_steps: int = 10
    """steps per environment per rollout (Brax's short unrolls)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    gamma: float = 0.99
    """discount factor (CleanRL's; at Brax's 0.97, a ~33-step horizon, inverted_pendulum stalled below 900)"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    num_minibatches: int = 32
    """minibatches per epoch"""
    update_epochs: int = 4
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    norm_obs: NormObs = "auto"
    """normalise observations by a running mean and std; auto: off for the pendulums and hopper (raw learned better)"""
    norm_reward: bool = True
    """scale rewards by a running std of the discounted return"""
    clip_coef: float = 0.3
    """surrogate clipping coefficient epsilon"""
    clip_vloss: bool = False
    """clip the value loss around the old values (off, as in Brax's PPO)"""
    ent_coef: float = 0.0
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """global gradient-norm clipping"""
    target_kl: Optional[float] = None
    """stop the epochs of an update early once the approximate KL exceeds this (None: never)"""

    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    video_interval: int = 0
    """iterations between two videos, the first at iteration 1 (0: only the video after training)"""
    checkpoint_interval: int = 100
    """iterations between checkpoints to <run folder>/checkpoint.pt (0: only at the end, on Ctrl-C or SIGTERM)"""
    eval_episodes: int = 16
    """episodes of the deterministic (mean-action) policy evaluated after training, on as many new envs (0 skips)"""

    def __post_init__(self):
        kinds = {"env_id": EnvId, "backend": Backend, "norm_obs": NormObs}
        rules = {name: (getattr(self, name) in get_args(k), f"one of {get_args(k)}") for name, k in kinds.items()}
        positive = ("episode_length", "num_envs", "num_steps", "update_epochs", "num_seeds")
        rules |= {name: (getattr(self, name) > 0, "positive") for name in positive}
        batch_size = self.num_envs * self.num_steps
        rules |= {
            "num_minibatches": (
                self.num_minibatches > 0 and batch_size % self.num_minibatches == 0,
                f"a divisor of --num-envs * --num-steps = {batch_size}",
            ),
            "total_timesteps": (self.total_timesteps >= batch_size, f"at least one rollout ({batch_size} steps)"),
            "learning_rate": (self.learning_rate > 0, "> 0"),
            "clip_coef": (self.clip_coef > 0, "> 0"),
            "gamma": (0 < self.gamma <= 1, "in (0, 1]"),
            "gae_lambda": (0 <= self.gae_lambda <= 1, "in [0, 1]"),
            "ent_coef": (self.ent_coef >= 0, ">= 0"),
            "vf_coef": (self.vf_coef >= 0, ">= 0"),
            "max_grad_norm": (self.max_grad_norm > 0, "> 0"),
            "target_kl": (self.target_kl is None or self.target_kl > 0, "> 0"),
        }
        for name, (ok, rule) in rules.items():  # a ValueError here: one `error:` line (tyro's, shortened)
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(self, name)}")
        import_brax()  # without brax: one line, before anything is built


# Environment ----------------------------------------------------------------------------------
@functools.cache
def jitted_env(env_id: str, backend: str, num_envs: int, episode_length: int):
    """jit(vmap(...)) of the Brax env's reset and of a step with our auto-reset (Brax's restarts from the first reset's
    state and drops the final observation); cached: compiled once."""
    jax, envs = import_brax()
    jnp, env = jax.numpy, envs.get_environment(env_id, backend=backend)

    def reset(key):  # -> (state, episode length, episode return, key)
        key, sub = jax.random.split(key)
        zeros = jnp.zeros(num_envs)
        return jax.vmap(env.reset)(jax.random.split(sub, num_envs)), zeros.astype(jnp.int32), zeros, key

    def step(state, length, ret, key, action):
        nxt = jax.vmap(env.step)(state, jnp.clip(action, -1.0, 1.0))
        length, ret, terminated = length + 1, ret + nxt.reward, nxt.done > 0
        truncated = (length >= episode_length) & ~terminated
        done = terminated | truncated
        fresh, _, _, key = reset(key)  # new episodes for the finished envs (drawn for all: no dynamic shapes in jit)
        pick = lambda new, old: jnp.where(done.reshape(done.shape + (1,) * (old.ndim - 1)), new, old)
        state = jax.tree.map(pick, fresh, nxt)
        info = dict(final_obs=nxt.obs, episode_return=ret, episode_length=length)  # valid where done
        out = (state.obs, nxt.reward, terminated, truncated, info)  # as a gymnasium vector env's step returns
        return state, jnp.where(done, 0, length), jnp.where(done, 0.0, ret), key, out

    return env, jax.jit(reset), jax.jit(step)


class BraxVecEnv:
    """Brax envs with gymnasium's vector API on torch tensors, actions clipped to [-1, 1]; finished envs reset inside
    `step`, `info` holding final_obs, episode_return and episode_length where done. Building one compiles (seconds+)."""

    def __init__(self, env_id: str, backend: str, num_envs: int, episode_length: int, device, seed: int):
        self.jax = jax = import_brax()[0]
        self.env, self._reset, self._step = jitted_env(env_id, backend, num_envs, episode_length)
        self.device = torch.device(device)
        self.jax_device = torch.device("cuda" if jax.default_backend() == "gpu" else "cpu")  # to_jax copies there
        self.num_envs, self.max_episode_steps = num_envs, episode_length
        self.obs_dim, self.action_dim = self.env.observation_size, self.env.action_size
        # committed to JAX's device (this rank's GPU under torchrun) like reset's and step's outputs: no 2nd compilation
        jax_index = int(os.environ.get("LOCAL_RANK", "0")) % len(jax.devices())
        self.key = jax.device_put(jax.random.PRNGKey(seed), jax.devices()[jax_index])
        # compile now rather than in the first training steps: a reset and a step (reset() starts afresh)
        self.key = self._step(*self._reset(self.key), self.to_jax(torch.zeros(num_envs, self.action_dim)))[3]

    def to_torch(self, x) -> torch.Tensor:
        return torch.from_dlpack(x).to(self.device)

    def to_jax(self, t: torch.Tensor):
        return self.jax.dlpack.from_dlpack(t.detach().to(self.jax_device).contiguous())

    def reset(self):
        self.state, self._length, self._return, self.key = self._reset(self.key)
        return self.to_torch(self.state.obs), {}

    def step(self, action: torch.Tensor):
        carry = self._step(self.state, self._length, self._return, self.key, self.to_jax(action.float()))
        self.state, self._length, self._return, self.key, out = carry
        return self.jax.tree.map(self.to_torch, out)  # (obs, reward, terminated, truncated, info)

    def state_dict(self) -> dict:
        """What a checkpoint needs to go on exactly, as CPU tensors (the uint32 key as int64, which torch saves)."""
        leaves = self.jax.tree.leaves((self.state, self._length, self._return, self.key))
        as_saved = lambda x: np.asarray(x).astype(np.int64 if x.dtype == np.uint32 else x.dtype)
        return {"leaves": [torch.from_numpy(as_saved(x)) for x in leaves]}

    def load_state_dict(self, saved: dict) -> torch.Tensor:
        old, tree = self.jax.tree.flatten((self.state, self._length, self._return, self.key))
        put = lambda t, x: self.jax.device_put(t.numpy().astype(x.dtype), next(iter(x.devices())))
        self.state, self._length, self._return, self.key = self.jax.tree.unflatten(tree, map(put, saved["leaves"], old))
        return self.to_torch(self.state.obs)


# Agent ----------------------------------------------------------------------------------------
def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """Orthogonal weights, constant bias (detail 2)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Tanh(nn.Module):
    """nn.Tanh; under torch.compile 2σ(2x) - 1 (equal within 2e-7): inductor's tanh costs ~2x as much on a CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * torch.sigmoid(2 * x) - 1 if torch.compiler.is_compiling() else torch.tanh(x)


def mlp(in_dim: int, out_dim: int, out_std: float) -> nn.Sequential:
    hidden = [layer_init(nn.Linear(in_dim, 64)), Tanh(), layer_init(nn.Linear(64, 64)), Tanh()]
    return nn.Sequential(*hidden, layer_init(nn.Linear(64, out_dim), std=out_std))


class Agent(nn.Module):
    """Separate 64-64 tanh actor (Gaussian mean, state-independent log-std) and critic, on observations `normalize`d by
    running statistics (`RunningMeanStd`, below `train`)."""

    def __init__(self, obs_dim: int, action_dim: int, norm_obs: bool = True):
        super().__init__()
        self.register_buffer("norm_obs", torch.tensor(norm_obs))  # saved: a loaded model normalises as trained
        self.obs_rms = RunningMeanStd((obs_dim,))
        self.critic, self.actor_mean = mlp(obs_dim, 1, out_std=1.0), mlp(obs_dim, action_dim, out_std=0.01)
        self.actor_logstd = nn.Parameter(torch.zeros(action_dim))

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:  # by the running mean and std if the agent normalises
        return torch.where(self.norm_obs, self.obs_rms.normalize(obs), obs)  # torch.where: no GPU sync

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def get_action(self, obs: torch.Tensor, greedy: bool = False) -> torch.Tensor:  # sampled; `greedy`: the mean
        mean = self.actor_mean(obs)
        return mean if greedy else mean + self.actor_logstd.exp() * torch.randn_like(mean)

    def forward(self, obs: torch.Tensor, action: torch.Tensor):
        """Log-probability of `action`, entropy, and value (diagonal Gaussian, summed over action dims)."""
        mean, logstd = self.actor_mean(obs), self.actor_logstd.expand(obs.shape[0], -1)
        logprob = (-0.5 * ((action - mean) / logstd.exp()).square() - logstd - 0.5 * math.log(2 * math.pi)).sum(-1)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + logstd).sum(-1)
        return logprob, entropy, self.get_value(obs)


# Algorithm ------------------------------------------------------------------------------------
class Rollout(NamedTuple):
    """T steps of N envs, (T, N) each or (T, N, dim), on the device: `raw_obs` as the envs returned them, `obs` and
    `final_obs` (s'_t before any auto-reset) normalised; `terminated`: no future to bootstrap; `dones`: an episode
    ended, its return in `episode_return`; `rewards` scaled with --norm-reward."""

    raw_obs: torch.Tensor
    obs: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    terminated: torch.Tensor
    dones: torch.Tensor
    final_obs: torch.Tensor
    episode_return: torch.Tensor
    episode_length: torch.Tensor

    @staticmethod
    def empty(num_steps: int, num_envs: int, obs_dim: int, action_dim: int, device: torch.device) -> Rollout:
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(num_steps, num_envs, *shape, dtype=dtype, device=device)
        shapes = dict(raw_obs=(obs_dim,), obs=(obs_dim,), actions=(action_dim,), final_obs=(obs_dim,))
        dtypes = dict(terminated=torch.bool, dones=torch.bool, episode_length=torch.int32)
        return Rollout(*(zeros(*shapes.get(f, ()), dtype=dtypes.get(f, torch.float32)) for f in Rollout._fields))


class Batch(NamedTuple):
    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor  # log π_old(a|s)
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor  # V_old(s)


@torch.no_grad()
def collect_rollout(agent: Agent, envs: BraxVecEnv, raw_obs: torch.Tensor, rollout: Rollout, scale_reward=None):
    """Fill `rollout`; return the next raw observation (normalised by earlier rollouts' statistics)."""
    for t in range(len(rollout.obs)):
        rollout.raw_obs[t] = raw_obs
        rollout.obs[t] = obs = agent.normalize(raw_obs)
        rollout.actions[t] = action = agent.get_action(obs)
        raw_obs, reward, terminated, truncated, info = envs.step(action)
        rollout.rewards[t] = reward if scale_reward is None else scale_reward(reward, terminated | truncated)
        rollout.terminated[t], rollout.dones[t] = terminated, terminated | truncated
        rollout.final_obs[t] = agent.normalize(info["final_obs"])
        rollout.episode_return[t], rollout.episode_length[t] = info["episode_return"], info["episode_length"]
    agent.obs_rms.update(rollout.raw_obs)  # also when unused (norm_obs off): an `if` on the buffer waits for the GPU
    if scale_reward is not None:
        scale_reward.update()
    return raw_obs


def compute_gae(rewards, values, next_values, terminated, dones, gamma: float, gae_lambda: float):
    """GAE over (T, N) -> (advantages, returns): `next_values[t]` is V(s'_t) of the true next state, so a truncated
    episode is bootstrapped (only `terminated` zeroes the future); `dones` cuts the recursion at every episode's end."""
    deltas = rewards + gamma * next_values * (~terminated).to(values.dtype) - values
    decay = gamma * gae_lambda * (~dones).to(values.dtype)
    advantages = torch.empty_like(deltas)
    lastgaelam = torch.zeros_like(deltas[0])
    for t in reversed(range(deltas.shape[0])):
        lastgaelam = deltas[t] + decay[t] * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def make_batch(agent: Agent, rollout: Rollout, args: Args) -> Batch:
    """π_old and V_old in batched passes over the whole rollout, then GAE; the rollout as T*N samples."""
    T, N = rollout.rewards.shape
    obs, actions = rollout.obs.view(T * N, -1), rollout.actions.flatten(0, 1)
    with torch.no_grad():
        logprobs, _, values = agent(obs, actions)
        next_values = agent.get_value(rollout.final_obs.view(T * N, -1)).view(T, N)
    advantages, returns = compute_gae(
        rollout.rewards, values.view(T, N), next_values, rollout.terminated, rollout.dones, args.gamma, args.gae_lambda
    )
    return Batch(obs, actions, logprobs, advantages.view(-1), returns.view(-1), values)


def ppo_loss(agent: Agent, args: Args, batch: Batch):
    """Clipped-surrogate PPO loss on a minibatch; returns (loss, statistics keyed by TensorBoard tag)."""
    newlogprob, entropy, newvalue = agent(batch.obs, batch.actions)
    logratio = newlogprob - batch.logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()  # the k3 estimator (detail 12)
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    advantages = batch.advantages
    if args.norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    if args.clip_vloss:
        v_clipped = batch.values + (newvalue - batch.values).clamp(-args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max((newvalue - batch.returns).square(), (v_clipped - batch.returns).square()).mean()
    else:
        v_loss = 0.5 * (newvalue - batch.returns).square().mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss
    stats = {
        "losses/policy_loss": pg_loss,
        "losses/value_loss": v_loss,
        "losses/entropy": entropy_loss,
        "losses/approx_kl": approx_kl,
        "losses/clipfrac": clipfrac,
        "losses/total_loss": loss,
    }
    return loss, {tag: value.detach() for tag, value in stats.items()}


def gradient_step(agent: nn.Module, optimizer: Adam, loss_fn, args, batch, idx=None) -> dict:
    """One Adam step on the loss of the rows `idx` of `batch` (None: all), the gradient's norm clipped (detail 11)."""
    minibatch = batch if idx is None else type(batch)(*(x[idx] for x in batch))
    optimizer.zero_grad()
    stats = optimizer.backward(loss_fn, agent, args, minibatch)  # loss.backward(), vmapped too (--num-seeds)
    stats = average_gradients(agent, stats)  # data parallel under torchrun; the stats: the ranks' means
    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm, foreach=False)  # vmap has no fused norms
    optimizer.step()
    return stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """1 - Var[R - V] / Var[R], the share of the returns' variance the critic explains; NaN (as CleanRL) for flat R."""
    var_returns = returns.var()
    return torch.where(var_returns == 0, torch.nan, 1 - (returns - values).var() / var_returns)


def one_epoch(step, batch: Batch, args: Args) -> list[dict[str, torch.Tensor]]:
    shuffled = torch.rand(len(batch.actions), device=batch.actions.device).argsort()
    return [step(batch, idx) for idx in shuffled.tensor_split(args.num_minibatches)]


def update(epoch, batch: Batch, args: Args) -> dict[str, torch.Tensor]:
    """`update-epochs` passes over the batch, each a `step` per shuffled minibatch (detail 6); their mean statistics."""
    history = []
    for _ in range(args.update_epochs):
        history += epoch(batch, args)
        # a host read per epoch; under torchrun the KL is the ranks' mean (gradient_step), so they stop together
        if args.target_kl is not None and history[-1]["losses/approx_kl"] > args.target_kl:
            break
    means = {tag: torch.stack([stats[tag] for stats in history]).mean() for tag in history[0]}
    return means | {"losses/explained_variance": explained_variance(batch.values, batch.returns)}


def train(args: Args) -> Agent:
    """Train PPO on the `--env-id` Brax env and return the agent (building the envs compiles: set-up time)."""
    device, T, N = torch.device(args.device), args.num_steps, args.num_envs
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with Run(args, evaluate, record_video) as run:
        # --total-timesteps counts all ranks' steps; --eval-only trains not at all (Run evaluates at the end)
        num_iterations = 0 if args.eval_only else args.total_timesteps // (T * N * world_size)
        if rank == 0:
            compiling = f"JAX compiles {args.env_id}'s reset and step for {N} envs first (tens of seconds on a CPU)"
            print(f"note: {compiling}", file=sys.stderr)
        for args in run.args_per_run:  # set up each run; then the last one's objects hold all K (--num-seeds, --sweep)
            torch.manual_seed(args.seed + rank)  # under torchrun each rank samples its own actions
            envs = BraxVecEnv(args.env_id, args.backend, N, args.episode_length, device, args.seed + rank)
            agent = Agent(envs.obs_dim, envs.action_dim, normalises_obs(args)).to(device)
            optimizer = Adam(agent, lr=args.learning_rate, eps=1e-5)  # eps: detail 3
            for group in optimizer.param_groups:  # --anneal-lr's start: each group's (each --sweep run's) rate
                group["first_lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64, device=device)
            scale_reward = RewardScaler(N, args.gamma, device) if args.norm_reward else None
            # --resume: all as the checkpoint left it; state of your own goes in by name (docs/modifying.md)
            total_steps = num_iterations * T * N * world_size
            raw_obs = run.start(agent, envs, optimizer, total_steps, envs.reset()[0], reward_scaler=scale_reward)
        rollout = run.one_by_one(Rollout.empty, T, N, envs.obs_dim, envs.action_dim, device)
        phases = (make_batch, gradient_step)
        prepare, step = [torch.compile(f, fullgraph=True) for f in phases] if args.compile else phases

        def learn(rollout):  # the batch and the update (the envs step in JAX: not in it); `agent` holds its state
            epoch = functools.partial(one_epoch, functools.partial(step, agent, optimizer, ppo_loss, args))
            return update(epoch, prepare(agent, rollout, args), args)

        # one call for all K runs (--num-seeds, --sweep), vmapped over their state; on a GPU one CUDA graph, replayed
        learn = run.one_call(learn)
        for iteration in run.iterations():
            for group in optimizer.param_groups if args.anneal_lr else ():  # in place: see ladder/optim.py
                group["lr"].copy_((1.0 - (iteration - 1.0) / num_iterations) * group["first_lr"])
            # --num-seeds K: the seeds' JAX envs step in turn, each seed's own objects (JAX is not vmapped by torch)
            raw_obs = run.one_by_one(collect_rollout, agent, envs, raw_obs, rollout, scale_reward)
            stats = learn(rollout)
            run.log(T * N, stats, finished_episodes(rollout))
            run.film(rollout)
            if run.target_reached():
                break
            run.checkpoint()  # every --checkpoint-interval iterations; last in the loop, so all its state is in it
    return agent


# What train() and the run call: brax, the normalisers, episodes, evaluation, videos
def import_brax():
    """jax and brax.envs, imported on first use (not on importing this script), after setting the variables read."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # else JAX takes most of a GPU, leaving torch none
    # read on MuJoCo's import: offscreen OpenGL for the MP4 ("egl" without libEGL fails the import)
    if ctypes.util.find_library("EGL"):
        os.environ.setdefault("MUJOCO_GL", "egl")
    # hushed: MuJoCo's warp, Brax's and JAXopt's notices; JAX's fork warning at ffmpeg's start (it execs: no deadlock)
    warnings.filterwarnings("ignore", message="Brax System, piplines and environments are not actively")
    warnings.filterwarnings("ignore", message="JAXopt is no longer maintained", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            import jax
            from brax import envs
    except ImportError:
        brax = "brax==0.14.2 jax==0.9.2 jaxlib==0.9.2"
        raise ModuleNotFoundError(f"this script needs brax and jax: pip install {brax}") from None
    for line in printed.getvalue().splitlines():
        if not line.startswith(("Failed to import warp:", "Failed to import mujoco_warp:")):
            print(line)
    return jax, envs


def normalises_obs(args: Args) -> bool:
    """--norm-obs resolved: `auto` is off where it learned worse, the pendulums and hopper"""
    raw_obs_envs = ("inverted_pendulum", "inverted_double_pendulum", "hopper")
    return args.norm_obs == "on" or (args.norm_obs == "auto" and args.env_id not in raw_obs_envs)


class RunningMeanStd(nn.Module):
    """Running mean and variance over batches (Chan et al.'s parallel update), in buffers: saved with the model. None
    is 0-dim: torch 2.13's compiler drops an in-place update of a 0-dim float64 tensor (docs/modifying.md)."""

    def __init__(self, shape=(1,), epsilon: float = 1e-4):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.full((1,), epsilon, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, *self.mean.shape).double()
        batch_mean, batch_var, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        if dist.is_initialized() and dist.get_world_size() > 1:  # torchrun: all ranks' batches (of one size each)
            moments = torch.stack([batch_mean, x.square().mean(0)])
            dist.all_reduce(moments)  # summed over the ranks
            batch_mean, mean_square = moments / dist.get_world_size()
            batch_var, n = mean_square - batch_mean.square(), n * dist.get_world_size()
        delta, total = batch_mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.var.copy_((self.var * self.count + batch_var * n + delta.square() * self.count * n / total) / total)
        self.count.copy_(total)

    def normalize(self, x: torch.Tensor, clip: float = 10.0) -> torch.Tensor:
        return ((x - self.mean.float()) / torch.sqrt(self.var.float() + 1e-8)).clamp(-clip, clip)


class RewardScaler(nn.Module):
    """Rewards over a running std of each env's discounted return (gymnasium's NormalizeReward), from earlier rollouts
    (`update` ends each): updated per step, the first steps' N equal returns gave a std near 0 and rewards ~1000x."""

    def __init__(self, num_envs: int, gamma: float, device: torch.device):
        super().__init__()
        self.gamma, self.return_rms, self.rollout_returns = gamma, RunningMeanStd().to(device), []
        # a buffer, so a checkpoint keeps it: a resumed run goes on with the episodes it was in
        self.register_buffer("discounted_return", torch.zeros(num_envs, device=device))

    def forward(self, reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        self.discounted_return = self.discounted_return * self.gamma + reward
        self.rollout_returns.append(self.discounted_return)
        self.discounted_return = self.discounted_return.masked_fill(done, 0.0)
        return reward / torch.sqrt(self.return_rms.var.float() + 1e-8)

    def update(self) -> None:  # this rollout's discounted returns join the statistics
        self.return_rms.update(torch.stack(self.rollout_returns))
        self.rollout_returns.clear()


def finished_episodes(rollout: Rollout):
    """(ended, return, length), tensors of one shape: the episodes that ended during `rollout`."""
    return rollout.dones, rollout.episode_return, rollout.episode_length


def evaluate(agent: Agent, envs, args: Args, video: Optional[str], num_envs: Optional[int] = None) -> list[float]:
    """One episode's return in each of `eval-episodes` (or `num_envs`) new envs, mean action; `video`: one filmed."""
    envs = BraxVecEnv(
        args.env_id, args.backend, num_envs or args.eval_episodes, args.episode_length, envs.device, args.seed + 1
    )
    obs, _ = envs.reset()
    returns, states = torch.full((envs.num_envs,), float("nan"), device=envs.device), []
    with torch.no_grad():
        for _ in range(envs.max_episode_steps):
            if video is not None and returns[0].isnan():  # the first env's physics state, while its episode lasts
                states.append(envs.jax.tree.map(lambda x: x[0], envs.state.pipeline_state))
            obs, _, terminated, truncated, info = envs.step(agent.get_action(agent.normalize(obs), greedy=True))
            returns = torch.where((terminated | truncated) & returns.isnan(), info["episode_return"], returns)
            if not returns.isnan().any():
                break
    if video is not None:
        film(envs, states, video)
    return returns.tolist()


def record_video(agent: Agent, envs, rollout: Optional[Rollout], args: Args, path: str) -> Optional[str]:
    """One mean-action episode on a new 1-env copy, filmed at `path`; None where no offscreen renderer works."""
    evaluate(agent, envs, args, path, num_envs=1)
    return path if os.path.exists(path) else None


def film(envs: BraxVecEnv, states: list, path: str) -> None:
    """Physics `states` as brax's HTML viewer next to `path` and, where an offscreen renderer works, the MP4 `path`."""
    from brax.io import html

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path.removesuffix(".mp4") + ".html", "w") as f:
        f.write(html.render(envs.env.sys, states))
    try:
        import imageio.v2 as imageio
        from brax.io import image

        frames = image.render_array(envs.env.sys, states, width=320, height=240)
    except Exception as e:  # no OpenGL context: a headless machine without EGL or OSMesa
        print(f"note: no offscreen renderer for the MP4 ({type(e).__name__}; try MUJOCO_GL=egl)", file=sys.stderr)
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with imageio.get_writer(path, fps=round(1 / float(envs.env.dt)), macro_block_size=2) as writer:  # even sides: H.264
        for frame in frames:
            writer.append_data(frame)


def main() -> None:
    run_command_line(Args, train, THREADED_FROM_ENVS)


if __name__ == "__main__":
    main()
