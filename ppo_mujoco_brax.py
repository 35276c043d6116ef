"""PPO for continuous control on Brax physics (JAX), with a torch policy and zero-copy DLPack.

Brax simulates thousands of MuJoCo-style robots in parallel in jit-compiled JAX; the policy, the
rollout buffer and the PPO update are torch. Observations, rewards and actions cross between the
two through DLPack without copies (on the CPU, and on the GPU when both use the same card).

Run:
    python ppo_mujoco_brax.py                                     # ant, spring backend, 2048 envs
    python ppo_mujoco_brax.py --env-id inverted_pendulum --total-timesteps 2000000
    python ppo_mujoco_brax.py --env-id humanoid --backend generalized --device cuda
    python ppo_mujoco_brax.py --env-id hopper --capture-video     # brax's HTML viewer (+ MP4 where it can render)
    tensorboard --logdir runs

Environment: `brax.envs.get_environment(env_id, backend=...)`, jit(vmap(reset/step)) over
`--num-envs`, with our own auto-reset: Brax's AutoResetWrapper sends a finished env back to the
state of its very first reset (episodes are never re-randomised) and drops the final observation,
so finished envs here are reset from fresh random keys and the real last observation is kept in
`info["final_obs"]`. Episodes are cut at `--episode-length` steps (truncated, not terminated).
Actions are clipped to Brax's [-1, 1] when stepping.

Backend: `spring` by default, the fastest of Brax's pipelines (about 2x `generalized` for ant on
a CPU here); `generalized` is the most faithful to MuJoCo, `positional` and `mjx` lie between.

The update (Schulman et al. 2017; CleanRL's continuous-action details):
    π_θ(a|s) = N(μ_θ(s), diag(exp(log σ)²)),  log σ a learned state-independent vector
    s normalised by a running mean/std (--norm-obs auto: not on the pendulums and hopper), r scaled by a
      running std of the discounted return
    δ_t     = r_t + γ (1 - term_t) V(s'_t) - V(s_t)         s'_t: the real next state, also when
    Â_t     = δ_t + γλ (1 - done_t) Â_{t+1}                       the episode was cut by the time limit
    L_clip  = E[ max(-Â_t r_t(θ), -Â_t clip(r_t(θ), 1-ε, 1+ε)) ],  r_t(θ) = π_θ(a_t|s_t) / π_θold(a_t|s_t)
    L_V     = ½ E[(V_θ(s_t) - R_t)²],  R_t = Â_t + V_old(s_t)      (--clip-vloss: clipped around V_old as in PPO2)
    L       = L_clip - c_ent H[π_θ] + c_vf L_V
Defaults follow Brax's own PPO settings for many parallel envs (short unrolls, large batches,
4 epochs, 32 minibatches, ε = 0.3, lr 3e-4, no value clipping), with CleanRL's γ = 0.99.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from enum import Enum
from typing import Literal, NamedTuple, Optional, get_args

# libgomp's OpenMP threads wait for work by spinning, which starves our own threads whenever another program keeps
# a core busy (4x slower beside one CPU hog on 2 cores); sleeping instead costs little. It must be set before torch
# loads OpenMP; a value you export wins. README: "Threads and a busy machine".
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro

EnvId = Literal["ant", "halfcheetah", "hopper", "walker2d", "humanoid", "inverted_pendulum", "inverted_double_pendulum",
                "reacher", "pusher"]  # fmt: skip
Backend = Literal["spring", "positional", "generalized", "mjx"]
NormObs = Literal["auto", "on", "off"]
# where raw observations learned better than normalised ones (README: "Observation normalisation")
RAW_OBS_ENVS = ("inverted_pendulum", "inverted_double_pendulum", "hopper")


@dataclass
class Args:
    # Algorithm
    env_id: EnvId = "ant"
    """the Brax environment"""
    backend: Backend = "spring"
    """the Brax physics pipeline: spring (fastest), positional, generalized (most accurate) or mjx"""
    episode_length: int = 1000
    """steps after which an episode is truncated"""
    total_timesteps: int = 5_000_000
    """environment steps in total, all torchrun ranks together"""
    target_return: Optional[float] = None
    """stop once the mean return of the last 100 episodes reaches this (None: run all steps)"""
    learning_rate: float = 3e-4
    """Adam learning rate"""
    num_envs: int = 2048
    """parallel environments (per process under torchrun)"""
    num_steps: int = 10
    """steps per environment per rollout (Brax's short unrolls)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    gamma: float = 0.99
    """discount factor (0.99, as CleanRL's MuJoCo PPO; at Brax's 0.97, a ~33-step horizon,
    inverted_pendulum policies let the cart drift and fail at step 750-960 of 1000, stalling below 900)"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    num_minibatches: int = 32
    """minibatches per epoch"""
    update_epochs: int = 4
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    norm_obs: NormObs = "auto"
    """normalise observations with a running mean and std (kept with the model); auto: off for
    inverted_pendulum, inverted_double_pendulum and hopper, where raw observations learned better, on elsewhere"""
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

    # Run management and logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    seed: int = 1
    """seed of the networks, the action sampling and the environments"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """torch device for the policy and the update (cuda when available, else cpu)"""
    torch_threads: int = 0
    """CPU threads for torch (ignored on GPU); 0 picks one thread below 1024 envs,
    where the ops are too small to gain from a second one, else one per available core"""
    compile: bool = False
    """torch.compile the batch preparation and the gradient step into graphs (the env step is Brax's own
    jitted JAX): faster iterations after a one-off compilation in iteration 1 (not counted in SPS)"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "rl-ladder"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team); None uses your default"""
    capture_video: bool = False
    """film one episode of the mean-action policy on a separate 1-env copy of the env, every `video-interval`
    iterations and after training (with the evaluation): brax's HTML viewer, and an MP4 where an offscreen
    renderer works"""
    video_interval: int = 0
    """iterations between two videos, the first at iteration 1 (0: only the video after training)"""
    save_model: bool = False
    """save the agent's weights and observation statistics to the run folder at the end (also on Ctrl-C)"""
    checkpoint_interval: int = 100
    """iterations between checkpoints, <run folder>/checkpoint.pt with all it takes to go on exactly (see
    `resume`); 0: only the one written when the run ends, Ctrl-C and SIGTERM included"""
    resume: Optional[str] = None
    """a run folder (or checkpoint file) to go on from, in that folder; flags left out keep the checkpoint's
    values, and only --total-timesteps, --target-return and the run-management flags may change"""
    eval_only: bool = False
    """no training: play `eval-episodes` episodes with the `load-model` weights (filmed with --capture-video)"""
    load_model: Optional[str] = None
    """the weights for --eval-only: a saved .cleanrl_model or a checkpoint.pt"""
    eval_episodes: int = 16
    """episodes of the deterministic (mean-action) policy evaluated after training (0 skips)"""
    progress_bar: bool = True
    """show a live progress bar with SPS and the recent return"""


DATA_PARALLEL = True  # runs under torchrun, one process per GPU or CPU share (README: "Scaling out")
THREADED_FROM_ENVS = 1024  # one torch thread below this many envs (README: "Threads and a busy machine")


class UsageError(ValueError):
    """A bad flag, an impossible combination of flags or a missing package: reported in one line."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite."""


class StopRequested(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM arrived: the run stopped at the end of an iteration, a safe point to checkpoint."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------
def import_brax():
    """jax and brax.envs, imported on first use (the module loads without them) and after setting the
    environment variables they read when they start: call it before anything imports jax or brax (MuJoCo
    reads MUJOCO_GL once, on import; without it, rendering the MP4 aborts the process on a headless machine)."""
    # JAX grabs most of a GPU's memory when it starts unless told not to; torch needs its share.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # MuJoCo's renderer (for the MP4 of --capture-video) needs an offscreen OpenGL: EGL, not a window.
    os.environ.setdefault("MUJOCO_GL", "egl")
    # Not the user's business, so kept quiet: MuJoCo's optional GPU backend (warp, not installed) prints
    # "Failed to import warp" on import, and Brax warns that it is no longer maintained (and JAXopt, which it
    # imports, likewise). Anything else they print or warn gets through.
    warnings.filterwarnings("ignore", message="Brax System, piplines and environments are not actively")
    warnings.filterwarnings("ignore", message="JAXopt is no longer maintained", category=DeprecationWarning)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            import jax
            from brax import envs
    except ImportError:
        raise UsageError("this script needs brax and jax: pip install brax==0.14.2 jax==0.9.2 jaxlib==0.9.2") from None
    for line in printed.getvalue().splitlines():
        if not line.startswith(("Failed to import warp:", "Failed to import mujoco_warp:")):
            print(line)
    return jax, envs


@functools.cache
def jitted_env(env_id: str, backend: str, num_envs: int, episode_length: int):
    """The Brax env and jit(vmap(...)) of its reset and of a step with our auto-reset. Cached: another
    BraxVecEnv of the same configuration reuses the compiled code."""
    jax, envs = import_brax()
    import jax.numpy as jnp

    env = envs.get_environment(env_id, backend=backend)

    def reset(key):
        key, sub = jax.random.split(key)
        state = jax.vmap(env.reset)(jax.random.split(sub, num_envs))
        zeros = jnp.zeros(num_envs)
        return state, zeros.astype(jnp.int32), zeros, key

    def step(state, length, ret, key, action):
        nxt = jax.vmap(env.step)(state, jnp.clip(action, -1.0, 1.0))
        length, ret = length + 1, ret + nxt.reward
        terminated = nxt.done > 0
        truncated = (length >= episode_length) & ~terminated
        done = terminated | truncated
        # fresh random initial states for the finished envs (drawn for all: no data-dependent shapes under jit)
        key, sub = jax.random.split(key)
        fresh = jax.vmap(env.reset)(jax.random.split(sub, num_envs))
        pick = lambda new, old: jnp.where(done.reshape(done.shape + (1,) * (old.ndim - 1)), new, old)
        state = jax.tree.map(pick, fresh, nxt)
        out = (state.obs, nxt.reward, terminated, truncated, nxt.obs, ret, length)
        return state, jnp.where(done, 0, length), jnp.where(done, 0.0, ret), key, out

    return env, jax.jit(reset), jax.jit(step)


class BraxVecEnv:
    """A batch of Brax envs with gymnasium's vector API and torch tensors on `device`.

    reset() -> (obs, info); step(action) -> (obs, reward, terminated, truncated, info). Finished
    envs are reset inside `step` from fresh random keys; `info` holds, per env and valid where
    terminated | truncated: "final_obs" (the real last observation), "episode_return",
    "episode_length". Arrays cross between JAX and torch through DLPack, without copies when both
    live on the same device. Building one compiles reset and step (seconds to a minute).
    """

    def __init__(self, env_id: str, backend: str, num_envs: int, episode_length: int, device, seed: int):
        jax, _ = import_brax()
        self.jax = jax
        self.env, self._reset, self._step = jitted_env(env_id, backend, num_envs, episode_length)
        self.device = torch.device(device)
        # where JAX computes; torch tensors on another device are moved (copied) across
        self.jax_device = torch.device("cuda" if jax.default_backend() == "gpu" else "cpu")
        self.num_envs, self.max_episode_steps = num_envs, episode_length
        self.obs_dim, self.action_dim = self.env.observation_size, self.env.action_size
        # A key committed to JAX's device, as the arrays that reset and step return are: with an uncommitted
        # one, the first reset and step would be compiled a second time for those.
        # (under torchrun on GPUs, this rank's GPU LOCAL_RANK, as torch's)
        jax_index = int(os.environ.get("LOCAL_RANK", "0")) % len(jax.devices())
        self._key = jax.device_put(jax.random.PRNGKey(seed), jax.devices()[jax_index])
        # compile now rather than in the first training steps: a reset and a step (reset() starts afresh)
        state, length, ret, key = self._reset(self._key)
        self._key = self._step(state, length, ret, key, self.to_jax(torch.zeros(num_envs, self.action_dim)))[3]
        self.state = None

    def to_torch(self, x) -> torch.Tensor:
        t = torch.from_dlpack(x)
        return t if t.device == self.device else t.to(self.device)

    def to_jax(self, t: torch.Tensor):
        return self.jax.dlpack.from_dlpack(t.detach().to(self.jax_device).contiguous())

    def state_dict(self) -> dict:
        """The random key the resets draw from (the physics states are not saved: a resumed run resets)."""
        return {"key": torch.from_numpy(np.asarray(self._key).astype(np.int64))}

    def load_state_dict(self, saved: dict) -> None:
        self._key = self.jax.device_put(saved["key"].numpy().astype(np.uint32), next(iter(self._key.devices())))

    def reset(self):
        self.state, self._length, self._return, self._key = self._reset(self._key)
        return self.to_torch(self.state.obs), {}

    def step(self, action: torch.Tensor):
        self.state, self._length, self._return, self._key, out = self._step(
            self.state, self._length, self._return, self._key, self.to_jax(action.float())
        )
        obs, reward, terminated, truncated, final_obs, ret, length = (self.to_torch(x) for x in out)
        info = {"final_obs": final_obs, "episode_return": ret, "episode_length": length}
        return obs, reward, terminated, truncated, info


# ----------------------------------------------------------------------------------------------
# Agent
# ----------------------------------------------------------------------------------------------
class RunningMeanStd(nn.Module):
    """Running mean and variance over batches (Chan et al.'s parallel update), kept as buffers so they save
    with the model."""

    def __init__(self, shape=(), epsilon: float = 1e-4):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(epsilon, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, *self.mean.shape).double()
        batch_mean, batch_var, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        if dist.is_initialized() and dist.get_world_size() > 1:  # torchrun: the statistics of all ranks' batches
            sums = torch.cat((x.sum(0).flatten(), x.square().sum(0).flatten(), x.new_tensor([n])))
            dist.all_reduce(sums)
            n = sums[-1]
            batch_mean = (sums[: self.mean.numel()] / n).view_as(self.mean)
            batch_var = (sums[self.mean.numel() : -1] / n).view_as(self.mean) - batch_mean.square()
        delta, total = batch_mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.var.copy_((self.var * self.count + batch_var * n + delta.square() * self.count * n / total) / total)
        self.count.copy_(total)

    def normalize(self, x: torch.Tensor, clip: float = 10.0) -> torch.Tensor:
        return ((x - self.mean.float()) / torch.sqrt(self.var.float() + 1e-8)).clamp(-clip, clip)


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """Orthogonal weights, constant bias (detail 2)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Tanh(nn.Module):
    """tanh; in a torch.compile'd graph written 2σ(2x) - 1, the same within 2e-7: inductor's exact tanh
    kernel costs ~2x as much on a CPU, where the activations are a large share of a small net's time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * torch.sigmoid(2 * x) - 1 if torch.compiler.is_compiling() else torch.tanh(x)


def mlp(in_dim: int, out_dim: int, out_std: float) -> nn.Sequential:
    """A 64-64 tanh network whose output layer starts at scale `out_std`."""
    return nn.Sequential(
        layer_init(nn.Linear(in_dim, 64)), Tanh(),
        layer_init(nn.Linear(64, 64)), Tanh(),
        layer_init(nn.Linear(64, out_dim), std=out_std),
    )  # fmt: skip


def normalises_obs(args: Args) -> bool:
    """--norm-obs resolved: `auto` is off on RAW_OBS_ENVS. There the statistics move a lot as the policy
    improves (inverted_pendulum: the cart position's std grows ~7x after the first rollouts), shifting the
    inputs of a policy that PPO's clipping otherwise keeps close to the last one."""
    return args.norm_obs == "on" or (args.norm_obs == "auto" and args.env_id not in RAW_OBS_ENVS)


class Agent(nn.Module):
    """Separate 64-64 tanh actor (Gaussian mean, state-independent log-std) and critic, plus the observation
    statistics. The networks take normalised observations: `normalize` them first."""

    def __init__(self, obs_dim: int, action_dim: int, norm_obs: bool = True):
        super().__init__()
        self.norm_obs = norm_obs
        self.obs_rms = RunningMeanStd((obs_dim,))
        self.critic = mlp(obs_dim, 1, out_std=1.0)
        self.actor_mean = mlp(obs_dim, action_dim, out_std=0.01)
        self.actor_logstd = nn.Parameter(torch.zeros(action_dim))

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        """Observations scaled by the running mean and std (unchanged with --no-norm-obs)."""
        return self.obs_rms.normalize(obs) if self.norm_obs else obs

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def get_action(self, obs: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """A sampled action, or with `greedy` the mean action."""
        mean = self.actor_mean(obs)
        return mean if greedy else mean + self.actor_logstd.exp() * torch.randn_like(mean)

    def forward(self, obs: torch.Tensor, action: torch.Tensor):
        """Log-probability of `action`, entropy, and value (diagonal Gaussian, summed over action dims)."""
        mean, logstd = self.actor_mean(obs), self.actor_logstd.expand(obs.shape[0], -1)
        logprob = (-0.5 * ((action - mean) / logstd.exp()).square() - logstd - 0.5 * math.log(2 * math.pi)).sum(-1)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + logstd).sum(-1)
        return logprob, entropy, self.get_value(obs)


# ----------------------------------------------------------------------------------------------
# Algorithm
# ----------------------------------------------------------------------------------------------
class Rollout(NamedTuple):
    """T steps of N envs, preallocated on the device."""

    raw_obs: torch.Tensor  # (T, N, obs_dim) the observations as the envs returned them
    obs: torch.Tensor  # (T, N, obs_dim) the same, normalised: what each action was chosen on
    actions: torch.Tensor  # (T, N, action_dim)
    rewards: torch.Tensor  # (T, N) scaled with --norm-reward
    terminated: torch.Tensor  # (T, N) the episode failed at this step: no future to bootstrap
    dones: torch.Tensor  # (T, N) terminated or truncated: an episode ended at this step
    final_obs: torch.Tensor  # (T, N, obs_dim) s'_t, the real next state (before any auto-reset), normalised
    episode_return: torch.Tensor  # (T, N) the episode's return so far: its full return where done
    episode_length: torch.Tensor  # (T, N)

    @staticmethod
    def empty(num_steps: int, num_envs: int, obs_dim: int, action_dim: int, device: torch.device) -> Rollout:
        def zeros(*shape, dtype=torch.float32):
            return torch.zeros((num_steps, num_envs, *shape), dtype=dtype, device=device)

        return Rollout(zeros(obs_dim), zeros(obs_dim), zeros(action_dim), zeros(), zeros(dtype=torch.bool),
                       zeros(dtype=torch.bool), zeros(obs_dim), zeros(), zeros(dtype=torch.int32))  # fmt: skip


class Batch(NamedTuple):
    """A rollout flattened to T*N samples, with what the loss needs."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor  # log π_old(a|s)
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor  # V_old(s)


class RewardScaler(nn.Module):
    """Divides rewards by a running std of the discounted return, each env's return so far discounted by
    γ and restarted at the end of each episode (as gymnasium's NormalizeReward). As with the observation
    statistics, a rollout is scaled by the statistics of the earlier ones and updates them at its end
    (`update`): updated every step, the first steps see N equal returns (all envs start together), a std
    near 0, and rewards scaled up ~1000x. Its state_dict holds the statistics; the returns so far are not
    in it (a resumed run starts new episodes)."""

    def __init__(self, num_envs: int, gamma: float, device: torch.device):
        super().__init__()
        self.gamma, self.return_rms = gamma, RunningMeanStd().to(device)
        self.discounted_return = torch.zeros(num_envs, device=device)
        self.rollout_returns = []

    def forward(self, reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        self.discounted_return = self.discounted_return * self.gamma + reward
        self.rollout_returns.append(self.discounted_return)
        self.discounted_return = self.discounted_return.masked_fill(done, 0.0)
        return reward / torch.sqrt(self.return_rms.var.float() + 1e-8)

    def update(self) -> None:
        """Add this rollout's discounted returns to the statistics."""
        self.return_rms.update(torch.stack(self.rollout_returns))
        self.rollout_returns.clear()


@torch.no_grad()
def collect_rollout(agent: Agent, envs: BraxVecEnv, raw_obs: torch.Tensor, rollout: Rollout, scale_reward=None):
    """Step every env T times with the current policy, filling `rollout`; return the next raw observation.

    The policy sees observations normalised with the statistics of the earlier rollouts; this
    rollout's raw observations update them at the end. `scale_reward` (a RewardScaler) scales rewards
    the same way: by the earlier rollouts' return statistics, updated at the end.
    """
    for t in range(len(rollout.obs)):
        rollout.raw_obs[t] = raw_obs
        rollout.obs[t] = obs = agent.normalize(raw_obs)
        action = agent.get_action(obs)
        raw_obs, reward, terminated, truncated, info = envs.step(action)
        rollout.actions[t] = action
        rollout.rewards[t] = reward if scale_reward is None else scale_reward(reward, terminated | truncated)
        rollout.terminated[t] = terminated
        rollout.dones[t] = terminated | truncated
        rollout.final_obs[t] = agent.normalize(info["final_obs"])
        rollout.episode_return[t] = info["episode_return"]
        rollout.episode_length[t] = info["episode_length"]
    if agent.norm_obs:
        agent.obs_rms.update(rollout.raw_obs)
    if scale_reward is not None:
        scale_reward.update()
    return raw_obs


def compute_gae(rewards, values, next_values, terminated, dones, gamma: float, gae_lambda: float):
    """Generalised advantage estimation over a (T, N) rollout; returns (advantages, returns).

    `next_values[t]` is V of the true next state s'_t: the real last observation where the episode
    ended, so a truncated episode is bootstrapped and only `terminated` zeroes the future.
    `dones` (terminated or truncated) cuts the recursion at every episode boundary.
    """
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
    advantages, returns = compute_gae(rollout.rewards, values.view(T, N), next_values, rollout.terminated,
                                      rollout.dones, args.gamma, args.gae_lambda)  # fmt: skip
    return Batch(obs, actions, logprobs, advantages.view(-1), returns.view(-1), values)


def ppo_loss(agent: Agent, args: Args, obs, actions, old_logprobs, advantages, returns, old_values):
    """Clipped-surrogate PPO loss for one minibatch; returns (loss, statistics keyed by TensorBoard tag)."""
    newlogprob, entropy, newvalue = agent(obs, actions)
    logratio = newlogprob - old_logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()  # the k3 estimator (detail 12)
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    if args.norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    if args.clip_vloss:
        v_clipped = old_values + (newvalue - old_values).clamp(-args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max((newvalue - returns).square(), (v_clipped - returns).square()).mean()
    else:
        v_loss = 0.5 * (newvalue - returns).square().mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss
    stats = {"losses/policy_loss": pg_loss, "losses/value_loss": v_loss, "losses/entropy": entropy_loss,
             "losses/approx_kl": approx_kl, "losses/clipfrac": clipfrac, "losses/total_loss": loss}  # fmt: skip
    return loss, {tag: value.detach() for tag, value in stats.items()}


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """1 - Var[R - V] / Var[R], the share of the returns' variance the critic explains; NaN when the
    returns are constant (as in CleanRL), where the ratio means nothing."""
    var_returns = returns.var()
    return torch.where(var_returns == 0, torch.nan, 1 - (returns - values).var() / var_returns)


def update(gradient_step, batch: Batch, args: Args) -> dict[str, torch.Tensor]:
    """`update-epochs` passes over the batch in shuffled minibatches (detail 6), one `gradient_step` each,
    ending early once the approximate KL exceeds `target-kl`.
    Returns the mean of each loss statistic and the critic's explained variance."""
    minibatch_size = len(batch.actions) // args.num_minibatches
    history = []
    for _ in range(args.update_epochs):
        for idx in torch.randperm(len(batch.actions), device=batch.actions.device).split(minibatch_size):
            stats = gradient_step(batch, idx)
            history.append(stats)
        # a host read per epoch; under torchrun the ranks judge their mean KL, so they stop together
        if args.target_kl is not None and mean_over_ranks(stats["losses/approx_kl"]) > args.target_kl:
            break
    means = {tag: torch.stack([stats[tag] for stats in history]).mean() for tag in history[0]}
    return means | {"losses/explained_variance": explained_variance(batch.values, batch.returns)}


def train(args: Args) -> Agent:
    """Train PPO on the `--env-id` Brax env and return the agent.

    Building the envs compiles their reset and step (set-up time, not counted in SPS). `Run` writes the
    outputs; Ctrl-C (KeyboardInterrupt) and a non-finite loss end the run with everything written.
    """
    device = torch.device(args.device)
    T, N = args.num_steps, args.num_envs
    with Run(args) as run:
        # --total-timesteps counts all ranks' steps; --eval-only trains not at all (Run evaluates at the end)
        num_iterations = 0 if args.eval_only else args.total_timesteps // (T * N * run.world_size)
        torch.manual_seed(args.seed + run.rank)  # under torchrun each rank samples its own actions
        envs = BraxVecEnv(args.env_id, args.backend, N, args.episode_length, device, args.seed + run.rank)
        agent = Agent(envs.obs_dim, envs.action_dim, normalises_obs(args)).to(device)  # rank 0's, see run.start
        optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
        scale_reward = RewardScaler(N, args.gamma, device) if args.norm_reward else None
        rollout = Rollout.empty(T, N, envs.obs_dim, envs.action_dim, device)
        raw_obs, _ = envs.reset()
        # with --resume: agent and normaliser, optimizer, reward scaler, RNGs and counters as the checkpoint left them
        raw_obs = run.start(agent, envs, optimizer, num_iterations * T * N * run.world_size, raw_obs,
                            reward_scaler=scale_reward)  # fmt: skip
        # the hot phases, torch.compile'd with --compile (the env step is JAX, jitted by Brax)
        prepare, gradient_step = hot_phases(agent, optimizer, ppo_loss, args, make_batch)
        for iteration in range(run.iteration + 1, num_iterations + 1):
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
            raw_obs = collect_rollout(agent, envs, raw_obs, rollout, scale_reward)
            batch = prepare(agent, rollout, args)
            stats = update(gradient_step, batch, args)
            if run.log(T * N, stats, rollout):  # True once the target return is reached
                break
    return agent


# ----------------------------------------------------------------------------------------------
# Speed: the gradient step and torch.compile (the same code in the CartPole scripts and the Brax one)
# ----------------------------------------------------------------------------------------------
def gradient_step(agent: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, args, batch, idx=None) -> dict:
    """One step of Adam on `loss_fn(agent, args, *minibatch)`, the minibatch being the rows `idx` of `batch`
    (all of it when None), with global gradient clipping (detail 11); returns the loss statistics."""
    loss, stats = loss_fn(agent, args, *(x if idx is None else x[idx] for x in batch))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    average_gradients(agent)  # data parallel under torchrun: the mean gradient over the ranks
    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return stats


def functional_gradient_step(agent: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, args):
    """`gradient_step` as one pure function of (lr, batch, idx), which torch.compile makes a single graph.

    torch.compile cuts `loss.backward()` and `optimizer.step()` into separate graphs (3x slower here),
    so the gradients come from torch.func.grad and the clipping and Adam's update are written out: the
    same arithmetic as clip_grad_norm_ and torch.optim.Adam, on the optimizer's own state tensors, so its
    state_dict and the eager path go on from where this left off.
    """
    params = dict(agent.named_parameters())
    (beta1, beta2), eps = optimizer.param_groups[0]["betas"], optimizer.param_groups[0]["eps"]
    state = [optimizer.state[p] for p in params.values()]
    for p, s in zip(params.values(), state):
        if not s:  # what torch.optim.Adam creates at its first step
            s.update(step=torch.zeros((), device=p.device), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    def loss_of(params, *minibatch):
        return loss_fn(lambda *x: torch.func.functional_call(agent, params, x), args, *minibatch)

    def step(lr, batch, idx=None):
        minibatch = (x if idx is None else x[idx] for x in batch)  # gathered inside the graph, fused
        grads, stats = torch.func.grad(loss_of, has_aux=True)(params, *minibatch)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        clip = (args.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for p, g, s in zip(params.values(), grads.values(), state):
                g = g * clip
                s["step"] += 1
                s["exp_avg"].lerp_(g, 1 - beta1)  # m = β1 m + (1 - β1) g
                s["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)  # v = β2 v + (1 - β2) g²
                denom = (s["exp_avg_sq"] / (1 - beta2 ** s["step"])).sqrt() + eps
                p.sub_(lr / (1 - beta1 ** s["step"]) * s["exp_avg"] / denom)
        return stats

    return step


def hot_phases(agent: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, args, *phases):
    """`phases` (functions of tensors) and `gradient_step(batch, idx)`: as written, or with --compile each
    one torch.compile'd into a single graph (fullgraph: a graph break is an error, not a silent slowdown)."""
    if not args.compile:
        return *phases, functools.partial(gradient_step, agent, optimizer, loss_fn, args)
    compile = functools.partial(torch.compile, fullgraph=True)
    step = compile(functional_gradient_step(agent, optimizer, loss_fn, args))
    group, device = optimizer.param_groups[0], next(agent.parameters()).device
    # the annealed learning rate goes in as a tensor: as a float it would be a constant, recompiled each iteration
    return *map(compile, phases), lambda *batch_idx: step(torch.tensor(group["lr"], device=device), *batch_idx)


# ----------------------------------------------------------------------------------------------
# Run management: the same code in all five scripts, but for the part marked environment-specific
# ----------------------------------------------------------------------------------------------
class Status(str, Enum):
    COMPLETED = "completed"
    TARGET_REACHED = "target return reached"
    INTERRUPTED = "interrupted"
    NON_FINITE_LOSS = "non-finite loss"
    ERROR = "error"
    EVALUATED = "evaluated"  # --eval-only


# flags that may differ from the checkpoint's on --resume: they change neither the algorithm nor its random draws
RESUMABLE_CHANGES = {"total_timesteps", "target_return", "device", "torch_threads", "compile", "track",
                     "wandb_project_name", "wandb_entity", "capture_video", "video_interval", "save_model",
                     "eval_episodes", "progress_bar", "checkpoint_interval", "resume"}  # fmt: skip


class Run:
    """Everything around the algorithm: the run folder runs/{env_id}__{exp_name}__{seed}__{time}, TensorBoard
    (and W&B with --track), the progress bar, logging, the stop on a non-finite loss, videos, checkpoints and
    --resume, SIGINT/SIGTERM, the model, the final evaluation and summary.json. `train` opens it with
    `with Run(args) as run:`, calls `run.start(...)` when training begins (which restores a checkpoint with
    --resume) and `if run.log(...): break` once per iteration. Leaving the block, normally or by an exception,
    writes everything; the exception then goes on to `main`."""

    def __init__(self, args):
        self.args = args
        self.name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
        self.dir = os.path.join("runs", self.name)
        self.saved = None  # the checkpoint to go on from, with --resume: in its run folder
        if args.resume:
            self.saved = read_checkpoint(args.resume)
            self.dir = os.path.dirname(checkpoint_file(args.resume)) or "."
            self.name = os.path.basename(os.path.abspath(self.dir))
        self.agent = self.envs = self.optimizer = self.progress = self.wandb = self.writer = self.threshold = None
        self.stateful: dict = {}  # what a checkpoint keeps: name -> object with state_dict()
        # under torchrun, rank 0 alone writes; the logged numbers cover every rank
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.iteration = self.global_step = self.episodes = self.uncounted_steps = self.resumed_at = 0
        self.resumed_seconds = 0.0  # training seconds before this process, with --resume
        self.recent_returns: deque[float] = deque(maxlen=100)
        self.solved_step = self.solved_seconds = None  # when the 100-episode mean first reached the threshold
        self.target_reached = False
        self.stop_signal = 0  # SIGINT or SIGTERM once one arrived: stop at the end of the iteration
        self.checkpointed_at = None  # the iteration of the last checkpoint written or restored
        self.signal_handlers: dict = {}

    def __enter__(self) -> Run:
        from torch.utils.tensorboard import SummaryWriter

        self.created = self.start_time = time.perf_counter()
        if self.rank != 0:
            return self
        self.made_dir = not os.path.isdir(self.dir)
        if self.args.track:
            import wandb

            self.wandb = wandb
            wandb.init(project=self.args.wandb_project_name, entity=self.args.wandb_entity, sync_tensorboard=True,
                       config=asdict(self.args), name=self.name, save_code=True,
                       id=self.saved and self.saved["wandb_id"], resume="allow")  # fmt: skip
        # with --resume, events logged after the checkpoint (by a run killed later) are hidden: no step twice
        self.writer = SummaryWriter(self.dir, purge_step=self.saved and self.saved["global_step"] + 1)
        if self.saved is None:
            table = "\n".join(f"|{key}|{value}|" for key, value in asdict(self.args).items())
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
        return self

    def start(self, agent: nn.Module, envs, optimizer: torch.optim.Optimizer, total_steps: int, obs=None, **stateful):
        """Training begins: the clock starts (set-up and compilation before it are not counted in SPS). With
        --resume, the agent, the optimizer, `stateful` (more objects with a state_dict, e.g. a reward scaler), the
        counters, the RNGs and the envs are restored from the checkpoint (`iteration` then counts the iterations
        done); with --load-model, the agent's weights. Returns `obs`, or the restored envs' observation."""
        self.agent, self.envs, self.optimizer = agent, envs, optimizer
        self.stateful = {"agent": agent, "optimizer": optimizer} | {k: v for k, v in stateful.items() if v is not None}
        self.device = next(agent.parameters()).device
        self.threshold = getattr(envs, "reward_threshold", None)
        if self.saved is not None:
            obs = self.restore(self.saved, obs)
            self.saved = None  # the tensors are in place now: free them
        elif self.args.load_model:
            saved = read_checkpoint(self.args.load_model, flag="--load-model")
            try:
                agent.load_state_dict(saved.get("agent", saved))  # a checkpoint's agent, or a saved model
            except RuntimeError as e:
                raise UsageError(f"--load-model {self.args.load_model} does not fit this agent: "
                                 f"{str(e).splitlines()[-1].strip()}") from None  # fmt: skip
        for tensor in agent.state_dict().values() if self.world_size > 1 else ():
            dist.broadcast(tensor, src=0)  # every rank starts from rank 0's weights (and statistics)
        if self.args.progress_bar and self.rank == 0 and not self.args.eval_only:
            from tqdm import tqdm

            self.progress = tqdm(total=total_steps, initial=self.global_step, unit="step", unit_scale=True,
                                 dynamic_ncols=True)  # fmt: skip
        if total_steps < 0.99 * self.args.total_timesteps and not self.args.eval_only:  # not for 5M -> 4,999,168
            self.note(
                f"--total-timesteps {self.args.total_timesteps:,} is rounded down to whole rollouts: {total_steps:,}"
            )
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            self.signal_handlers = {s: signal.signal(s, self.request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        self.total_steps, self.start_time = total_steps, time.perf_counter() - self.resumed_seconds
        self.created -= self.resumed_seconds
        return obs

    def request_stop(self, signum: int, frame) -> None:
        """SIGINT/SIGTERM handler: stop at the end of this iteration (checkpoint, logs, summary); a second Ctrl-C
        stops at once (the checkpoint is then the last periodic one)."""
        if signum == signal.SIGINT and self.stop_signal == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.stop_signal:
            self.stop_signal = signum
            self.note(f"{signal.Signals(signum).name}: stopping after this iteration, with a checkpoint "
                      "(Ctrl-C again: at once)")  # fmt: skip

    def note(self, message: str) -> None:
        """One line to stderr that does not break the progress bar (rank 0's only, under torchrun)."""
        if self.rank == 0:
            (self.progress.write if self.progress is not None else print)(f"note: {message}", file=sys.stderr)

    def log(self, env_steps: int, stats: dict[str, torch.Tensor], rollout) -> bool:
        """Log one iteration with a single host read; raise NonFiniteLossError on a NaN or infinite loss;
        film and checkpoint when due; raise StopRequested after SIGINT/SIGTERM. Returns True once the target
        return is reached. Under torchrun every rank gets every rank's numbers (one all-gather), so all take
        the same decisions, stopping on a signal too."""
        self.iteration += 1
        ended, returns, lengths = self.finished_episodes(rollout)
        scalars = [torch.tensor(float(env_steps), device=self.device), torch.tensor(float(self.stop_signal),
                   device=self.device), *stats.values()]  # fmt: skip
        episodes = torch.stack((ended.flatten().float(), returns.flatten().float(), lengths.flatten().float()))
        if self.world_size > 1:  # padded to the longest episode list of any rank, for one all-gather
            longest = torch.tensor(episodes.shape[1], device=self.device)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)
            episodes = nn.functional.pad(episodes, (0, int(longest) - episodes.shape[1]))
        local = torch.cat((torch.stack(scalars).float(), episodes.flatten()))
        gathered = [local]
        if self.world_size > 1:
            gathered = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(gathered, local)
        host = torch.stack(gathered).cpu().numpy()  # the iteration's one host read: (ranks, numbers)
        env_steps, stop_signal = int(host[:, 0].sum()), int(host[:, 1].max())  # every rank's steps and signals
        self.global_step += env_steps
        values = dict(zip(stats, host[:, 2 : len(scalars)].mean(0).tolist()))  # the ranks' mean losses
        ended, returns, lengths = (
            host[:, len(scalars) :].reshape(self.world_size, 3, -1).transpose(1, 0, 2).reshape(3, -1)
        )
        returns, lengths = returns[ended > 0], lengths[ended > 0]
        # explained variance is NaN by design when the returns are constant; every loss must be finite
        if not all(math.isfinite(v) for tag, v in values.items() if tag != "losses/explained_variance"):
            raise NonFiniteLossError(f"non-finite loss at iteration {self.iteration} (env step {self.global_step})")

        self.recent_returns.extend(returns.tolist())
        self.episodes += len(returns)
        elapsed = time.perf_counter() - self.start_time
        full = len(self.recent_returns) == self.recent_returns.maxlen
        mean_recent = float(np.mean(self.recent_returns)) if self.recent_returns else None
        if self.threshold is not None and self.solved_step is None and full and mean_recent >= self.threshold:
            self.solved_step, self.solved_seconds = self.global_step, elapsed
        target = self.args.target_return
        self.target_reached = target is not None and full and mean_recent >= target
        if self.rank == 0:  # the other ranks keep only the bookkeeping that decides when to stop
            self.write_iteration(env_steps, values, returns, lengths, mean_recent, elapsed, rollout)
        if self.args.checkpoint_interval and self.iteration % self.args.checkpoint_interval == 0:
            self.save_checkpoint()
        if stop_signal:
            raise StopRequested(stop_signal)
        return self.target_reached

    def write_iteration(self, env_steps: int, values: dict, returns, lengths, mean_recent, elapsed, rollout) -> None:
        """Rank 0's part of `log`: TensorBoard, the ETA note, the progress bar, videos, the compile burn-in."""
        sps = int((self.global_step - self.uncounted_steps) / elapsed)
        if len(returns):
            self.writer.add_scalar("charts/episodic_return", float(returns.mean()), self.global_step)
            self.writer.add_scalar("charts/episodic_length", float(lengths.mean()), self.global_step)
        self.writer.add_scalar("charts/learning_rate", self.optimizer.param_groups[0]["lr"], self.global_step)
        self.writer.add_scalar("charts/SPS", sps, self.global_step)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, self.global_step)
        remaining = (self.total_steps - self.global_step) / max(sps, 1)
        if self.iteration == self.resumed_at + 3 and remaining > 600:  # long defaults (Atari's 10M) should not surprise
            self.note(f"at {sps:,} steps/s the remaining {self.total_steps - self.global_step:,} steps take about "
                      f"{remaining / 3600:.1f} h; --total-timesteps sets the length")  # fmt: skip
        if self.progress is not None:
            self.progress.update(env_steps)
            self.progress.set_postfix(SPS=sps, ret="-" if mean_recent is None else f"{mean_recent:.1f}", refresh=False)
        interval = self.args.video_interval
        if self.args.capture_video and interval and (self.iteration - 1) % interval == 0:  # iterations 1, 1+k, ...
            path = self.record_video(rollout, self.iteration)
            if path is not None and self.wandb is not None:
                self.wandb.log({"videos/training": self.wandb.Video(path, format="mp4")})
        if self.iteration == self.resumed_at + 1 and getattr(self.args, "compile", False):
            # this process's first iteration compiled the graphs: SPS and the time to solve count from here
            # (LeanRL's burn-in)
            self.note(f"--compile: iteration {self.iteration} took {elapsed - self.resumed_seconds:.1f} s "
                      "(compilation), not counted in SPS")  # fmt: skip
            self.start_time = time.perf_counter() - self.resumed_seconds
            self.uncounted_steps += env_steps

    def save_checkpoint(self) -> None:
        """Write <run folder>/checkpoint.pt: the agent, the optimizer (with the learning rate), `stateful`,
        the counters and the recent returns, and per rank the RNGs and the envs' state. Written to a temporary
        file renamed over the old one, so a kill during the write leaves the previous checkpoint whole."""
        mine = {"rng": rng_state(self.device), "envs": self.envs_state()}
        ranks = [mine]
        if self.world_size > 1:  # every rank's RNGs and envs, to rank 0
            ranks = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, ranks, dst=0)
        self.checkpointed_at = self.iteration
        if self.rank != 0:
            return
        checkpoint = {name: obj.state_dict() for name, obj in self.stateful.items()} | {
            "script": os.path.basename(__file__),
            "args": asdict(self.args),
            "iteration": self.iteration,
            "global_step": self.global_step,
            "episodes": self.episodes,
            "recent_returns": list(self.recent_returns),
            "solved_step": self.solved_step,
            "solved_seconds": self.solved_seconds,
            "seconds": time.perf_counter() - self.start_time,  # training seconds so far (SPS, solve time)
            "setup_seconds": self.start_time - self.created,
            "uncounted_steps": self.uncounted_steps,
            "wandb_id": self.wandb.run.id if self.wandb is not None else None,
            "ranks": ranks,
        }
        path = os.path.join(self.dir, "checkpoint.pt")
        with open(path + ".tmp", "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename, so a crash cannot leave a renamed empty file
        os.replace(path + ".tmp", path)  # atomic

    def restore(self, saved: dict, obs):
        """--resume: everything `save_checkpoint` wrote back in place; returns the observation to go on from."""
        for name, obj in self.stateful.items():
            obj.load_state_dict(saved[name])
        self.iteration = self.resumed_at = self.checkpointed_at = saved["iteration"]
        self.global_step, self.episodes = saved["global_step"], saved["episodes"]
        self.recent_returns.extend(saved["recent_returns"])
        self.solved_step, self.solved_seconds = saved["solved_step"], saved["solved_seconds"]
        self.resumed_seconds, self.uncounted_steps = saved["seconds"], saved["uncounted_steps"]
        self.created -= saved["setup_seconds"]
        if len(saved["ranks"]) == self.world_size:
            set_rng_state(saved["ranks"][self.rank]["rng"], self.device)
            obs = self.restore_envs(saved["ranks"][self.rank]["envs"], obs)
        else:
            self.note(f"the checkpoint has {len(saved['ranks'])} ranks' envs and random states, this run "
                      f"{self.world_size}: the envs restart and the random draws differ")  # fmt: skip
        self.note(f"resumed {self.dir} at iteration {self.iteration} (step {self.global_step:,})")
        return obs

    def __exit__(self, exc_type, exc, tb) -> bool:
        for sig, handler in self.signal_handlers.items():
            signal.signal(sig, handler)
        if exc_type is None:
            status = Status.TARGET_REACHED if self.target_reached else Status.COMPLETED
            status = Status.EVALUATED if self.args.eval_only else status
        elif issubclass(exc_type, KeyboardInterrupt):
            status = Status.INTERRUPTED
        elif issubclass(exc_type, NonFiniteLossError):
            status = Status.NON_FINITE_LOSS
        else:
            status = Status.ERROR
        if self.progress is not None:
            self.progress.total = self.progress.n  # the bar ends where training ended
            self.progress.close()
        if exc_type is not None and issubclass(exc_type, UsageError):  # a bad flag found late: leave no trace
            if self.writer is not None:
                self.writer.close()
                if self.made_dir:
                    shutil.rmtree(self.dir, ignore_errors=True)
            return False
        # at the end of an iteration the state is whole: worth a checkpoint (not after a second Ctrl-C)
        at_safe_point = status in (Status.COMPLETED, Status.TARGET_REACHED) or exc_type is StopRequested
        if (
            self.agent is not None
            and at_safe_point
            and self.checkpointed_at != self.iteration
            and not self.args.eval_only
        ):
            self.save_checkpoint()
        if self.rank != 0:
            return False
        elapsed = time.perf_counter() - self.start_time
        summary = {  # the same keys in every script; None where a value does not apply
            "env_id": self.args.env_id,
            "exp_name": self.args.exp_name,
            "seed": self.args.seed,
            "device": self.args.device,
            "world_size": self.world_size,  # processes under torchrun (1 without)
            "status": status.value,
            "total_env_steps": self.global_step,
            "iterations": self.iteration,
            "wall_seconds": round(elapsed, 3),
            "setup_seconds": round(self.start_time - self.created, 3),  # before the clock: env, compilation
            "mean_sps": round((self.global_step - self.uncounted_steps) / elapsed, 1),
            "episodes": self.episodes,
            "mean_return_last_100": float(np.mean(self.recent_returns)) if self.episodes else None,
            "solved_threshold": self.threshold,
            "solved_at_step": self.solved_step,
            "solved_at_seconds": self.solved_seconds and round(self.solved_seconds, 3),
            "eval_returns": None,
            "eval_mean_return": None,
            "model_path": None,
        }
        if self.agent is not None and status is not Status.NON_FINITE_LOSS:  # NaN weights are not worth keeping
            if self.args.save_model:
                summary["model_path"] = os.path.join(self.dir, f"{self.args.exp_name}.cleanrl_model")
                torch.save(self.agent.state_dict(), summary["model_path"])
            if self.args.eval_episodes and status in (Status.COMPLETED, Status.TARGET_REACHED, Status.EVALUATED):
                summary["eval_returns"] = self.evaluate()
                summary["eval_mean_return"] = float(np.mean(summary["eval_returns"]))
                self.writer.add_scalar("eval/episodic_return", summary["eval_mean_return"], self.global_step)
        summary["args"] = asdict(self.args)
        with open(os.path.join(self.dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        print(self.result_line(summary))  # last, after W&B's own summary
        return False  # exceptions go on to main

    def result_line(self, s: dict) -> str:
        if s["status"] == Status.EVALUATED.value:
            mean = s["eval_mean_return"]
            line = f"evaluated {self.args.load_model}: " + ("no episodes" if mean is None else
                    f"mean return {mean:.1f} over {len(s['eval_returns'])} episodes")  # fmt: skip
            return line + f"; outputs in {self.dir}"
        mean = s["mean_return_last_100"]
        line = f"{s['status']}: {s['total_env_steps']:,} steps in {s['wall_seconds']:.1f} s ({s['mean_sps']:,.0f} SPS)"
        line += "; no episode finished" if mean is None else f"; mean return of the last 100 episodes {mean:.1f}"
        if self.threshold is not None and self.solved_step is None:
            line += f", did not reach {self.threshold:g}"
        elif self.threshold is not None:
            line += f", reached {self.threshold:g} at step {self.solved_step:,} ({self.solved_seconds:.1f} s)"
        if s["eval_mean_return"] is not None:
            line += f"; evaluation {s['eval_mean_return']:.1f} over {len(s['eval_returns'])} episodes"
        line += f"; outputs in {self.dir}"
        if s["status"] == Status.INTERRUPTED.value and os.path.exists(os.path.join(self.dir, "checkpoint.pt")):
            line += f"; go on with --resume {self.dir}"
        return line

    # ---- environment-specific part (the rest of Run is the same in all five scripts) ----
    def finished_episodes(self, rollout: Rollout):
        """(ended, return, length), tensors of one shape: the episodes that ended during `rollout`."""
        return rollout.dones, rollout.episode_return, rollout.episode_length

    def evaluate(self) -> list[float]:
        """Return of the first episode of `eval-episodes` fresh envs under the mean action (a copy of the
        training envs, seeded apart: same compiled code, and --eval-only on the saved model plays the same
        episodes); then, with --capture-video, the video of one more episode (uploaded with --track)."""
        n, agent, args = self.args.eval_episodes, self.agent, self.args
        envs = BraxVecEnv(args.env_id, args.backend, self.envs.num_envs, args.episode_length, self.device,
                          args.seed + 1)  # fmt: skip
        obs, _ = envs.reset()
        returns = torch.full((envs.num_envs,), float("nan"), device=self.device)
        with torch.no_grad():
            for _ in range(envs.max_episode_steps):
                obs, _, terminated, truncated, info = envs.step(agent.get_action(agent.normalize(obs), greedy=True))
                returns = torch.where((terminated | truncated) & returns.isnan(), info["episode_return"], returns)
                if not returns[:n].isnan().any():
                    break
        path = self.film("evaluation") if self.args.capture_video else None
        if path is not None and self.wandb is not None:
            self.wandb.log({"videos/evaluation": self.wandb.Video(path, format="mp4")})
        return returns[:n].tolist()

    def envs_state(self) -> dict:
        return self.envs.state_dict()

    def restore_envs(self, saved: dict, obs: torch.Tensor) -> torch.Tensor:
        """--resume: the envs' random key as saved; the physics states are not in a checkpoint: new episodes."""
        self.note("Brax's physics states are not in a checkpoint: the envs start new episodes")
        self.envs.load_state_dict(saved)
        return self.envs.reset()[0]

    def record_video(self, rollout: Rollout, iteration: int) -> str | None:
        """One episode under the mean action, played on a separate 1-env copy of the env so that the training
        envs' episodes go on undisturbed; returns the MP4's path (None where no offscreen renderer works)."""
        return self.film(f"episode_iter{iteration:05d}")

    def film(self, name: str) -> str | None:
        """Play one episode on the video env and write brax's HTML viewer of it to videos/{name}.html and,
        where an offscreen renderer works, videos/{name}.mp4."""
        from brax.io import html

        if not hasattr(self, "video_env"):  # built on the first video; its compilation counts as set-up, not training
            built = time.perf_counter()
            self.video_env = BraxVecEnv(self.args.env_id, self.args.backend, 1, self.args.episode_length,
                                        self.device, self.args.seed + 1)  # fmt: skip
            self.start_time += time.perf_counter() - built
        env, agent, states = self.video_env, self.agent, []
        obs, _ = env.reset()
        with torch.no_grad():
            for _ in range(env.max_episode_steps):
                states.append(env.jax.tree.map(lambda x: x[0], env.state.pipeline_state))
                obs, _, terminated, truncated, _ = env.step(agent.get_action(agent.normalize(obs), greedy=True))
                if bool(terminated[0] | truncated[0]):
                    break
        path = os.path.join(self.dir, "videos", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".html", "w") as f:
            f.write(html.render(env.env.sys, states))
        try:
            from brax.io import image

            frames = image.render_array(env.env.sys, states, width=320, height=240)
        except Exception as e:  # no OpenGL context: a headless machine without EGL or OSMesa
            self.note(f"no offscreen renderer for the MP4 ({type(e).__name__}; try MUJOCO_GL=egl on a GPU machine): "
                      f"kept {path}.html")  # fmt: skip
            return None
        write_video(frames, path + ".mp4", fps=int(round(1 / env.env.dt)))
        return path + ".mp4"


def write_video(frames: np.ndarray, path: str, fps: int) -> None:
    """An H.264 MP4 of RGB frames (T, H, W, 3) uint8, every one of them (moviepy's ImageSequenceClip drops the last)."""
    from moviepy.video.io.ffmpeg_writer import FFMPEG_VideoWriter

    os.makedirs(os.path.dirname(path), exist_ok=True)
    writer = FFMPEG_VideoWriter(path, (frames[0].shape[1], frames[0].shape[0]), fps)
    for frame in frames:
        writer.write_frame(frame)
    writer.close()


def validate(args: Args) -> torch.device:
    """Reject bad flags with one clear line (raised as UsageError) before anything is built; return the device."""
    positive = ("num_envs", "num_steps", "total_timesteps", "num_minibatches", "update_epochs", "episode_length")
    for name in positive:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.eval_episodes < 0 or args.torch_threads < 0 or args.video_interval < 0:
        raise UsageError("--eval-episodes, --torch-threads and --video-interval must be >= 0")
    if args.eval_episodes > args.num_envs:  # the evaluation plays on a copy of the training envs
        raise UsageError(f"--eval-episodes {args.eval_episodes} is more than --num-envs {args.num_envs}")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        raise UsageError(
            f"--num-envs * --num-steps = {batch_size} is not divisible by --num-minibatches {args.num_minibatches}"
        )
    if args.total_timesteps < batch_size:
        raise UsageError(f"--total-timesteps {args.total_timesteps} is smaller than one rollout ({batch_size} steps)")
    for name, ok, rule in (
        ("learning_rate", args.learning_rate > 0, "> 0"),
        ("gamma", 0 < args.gamma <= 1, "in (0, 1]"),
        ("gae_lambda", 0 <= args.gae_lambda <= 1, "in [0, 1]"),
        ("clip_coef", args.clip_coef > 0, "> 0"),
        ("ent_coef", args.ent_coef >= 0, ">= 0"),
        ("vf_coef", args.vf_coef >= 0, ">= 0"),
        ("max_grad_norm", args.max_grad_norm > 0, "> 0"),
        ("target_kl", args.target_kl is None or args.target_kl > 0, "> 0"),
    ):
        if not (ok and math.isfinite(getattr(args, name) or 0.0)):
            raise UsageError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}")
    for flag, value, choice in (
        ("env-id", args.env_id, EnvId),
        ("backend", args.backend, Backend),
        ("norm-obs", args.norm_obs, NormObs),
    ):
        if value not in get_args(choice):  # tyro checks the command line; Args(...) built in code come here unchecked
            raise UsageError(f"unknown --{flag} {value!r}; choose one of {', '.join(get_args(choice))}")
    import_brax()
    return validate_run_flags(args)


def validate_run_flags(args) -> torch.device:
    """The checks of the run-management flags, the same in all five scripts; returns the device."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"unknown --device {args.device!r}; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA GPU is available; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device} is not supported; use cpu or cuda")
    compiler = os.environ.get("CXX", {"win32": "cl", "darwin": "clang++"}.get(sys.platform, "g++"))  # inductor's
    if getattr(args, "compile", False) and device.type == "cpu" and not shutil.which(compiler):
        raise UsageError("--compile on the CPU needs a C++ compiler (torch.compile builds C++ kernels): "
                         "install g++ (or set CXX), or leave out --compile")  # fmt: skip
    for flag, module, pin in (("capture_video", "moviepy", "moviepy==2.2.1"), ("track", "wandb", "wandb==0.31.0")):
        if getattr(args, flag):
            try:
                __import__(module)
            except ImportError:
                raise UsageError(f"--{flag.replace('_', '-')} needs {module}: pip install {pin}") from None
    if args.checkpoint_interval < 0:
        raise UsageError(f"--checkpoint-interval must be >= 0, got {args.checkpoint_interval}")
    if args.eval_only != bool(args.load_model):
        raise UsageError("--eval-only and --load-model PATH go together (to train on from a checkpoint: --resume)")
    if args.resume and args.eval_only:
        raise UsageError("--resume trains on; to evaluate a checkpoint use --eval-only --load-model")
    if args.load_model:
        read_checkpoint(args.load_model, flag="--load-model")  # there, readable, and not another script's
    if args.resume:
        saved = read_checkpoint(args.resume)["args"]
        for name, value in saved.items():
            if name not in RESUMABLE_CHANGES and getattr(args, name, value) != value:
                raise UsageError(f"--resume: --{name.replace('_', '-')} {getattr(args, name)} differs from the "
                                 f"checkpoint's {value}; only --total-timesteps, --target-return and the "
                                 "run-management flags may change")  # fmt: skip
    return device


def checkpoint_file(path: str) -> str:
    """A run folder's checkpoint.pt, or `path` itself."""
    return os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path


def read_checkpoint(path: str, flag: str = "--resume") -> dict:
    """The checkpoint at `path` (with --load-model also a saved model), loaded to the CPU as plain data
    (weights_only: loading cannot run code); UsageError if it is missing, unreadable or another script's."""
    file, script = checkpoint_file(path), os.path.basename(__file__)
    if not os.path.isfile(file):
        raise UsageError(f"{flag} {path}: no such file")
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, or holding objects other than plain data
        raise UsageError(f"{flag} {file} is not a readable checkpoint ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(saved, dict) or saved.get("script", script) != script:
        raise UsageError(f"{flag} {file} was written by {saved.get('script', 'something else')}, not {script}")
    if flag == "--resume" and "iteration" not in saved:
        raise UsageError(f"--resume {file} holds weights only; evaluate them with --eval-only --load-model")
    return saved


def rng_state(device: torch.device) -> dict:
    """torch's global random state (and CUDA's on `device`) and numpy's, for a checkpoint."""
    key, pos, has_gauss, gauss = np.random.get_state()[1:]
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "numpy": (torch.from_numpy(key.astype(np.int64)), pos,
            has_gauss, gauss)}  # fmt: skip


def set_rng_state(saved: dict, device: torch.device) -> None:
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"], device)
    key, pos, has_gauss, gauss = saved["numpy"]
    np.random.set_state(("MT19937", key.numpy().astype(np.uint32), pos, has_gauss, gauss))


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of `value` over the torchrun ranks (itself in a single process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    total = value.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def average_gradients(module: nn.Module) -> None:
    """Data parallel under torchrun: each gradient becomes its mean over the ranks, in one all-reduce of
    all of them flattened together. Nothing to do in a single process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    for grad, mean in zip(grads, (flat / dist.get_world_size()).split([g.numel() for g in grads])):
        grad.copy_(mean.view_as(grad))


def join_process_group(args, device: torch.device) -> torch.device:
    """Under torchrun (WORLD_SIZE > 1): join the process group (NCCL on CUDA, Gloo on the CPU; a collective
    that waits 5 minutes for a lost rank fails instead of hanging) and return this rank's device, GPU
    LOCAL_RANK on CUDA. In a single process: the device unchanged."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device
    script = os.path.basename(sys.argv[0])
    if not DATA_PARALLEL:
        raise UsageError(f"{script} does not run under torchrun yet: run it as one process")
    if getattr(args, "compile", False):
        raise UsageError("--compile does not run under torchrun yet: leave out --compile")
    local_rank, local_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if device.type == "cuda":
        if torch.cuda.device_count() < local_size:
            raise UsageError(f"{local_size} processes per machine need as many GPUs; {torch.cuda.device_count()} found")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=5))
    return device


def available_cores() -> int:
    """CPU cores this process may run on (os.sched_getaffinity is Linux-only: elsewhere, all cores)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_args() -> Args:
    """tyro's command line, with its parse errors turned into one `error: ...` line and exit code 2 like ours."""
    flags = ["--" + field.replace("_", "-") for field in Args.__dataclass_fields__]

    def one_line(event) -> None:  # tyro calls this instead of printing its error box
        flag = "/".join(event.argument.lowered.name_or_flags) if getattr(event, "argument", None) else "arguments"
        if hasattr(event, "choices"):
            raise UsageError(f"unknown {flag} {event.value!r}; choose one of {', '.join(event.choices)}")
        if hasattr(event, "tokens"):
            guesses = [g for t in event.tokens for g in difflib.get_close_matches(t.split("=")[0], flags, n=1)]
            hint = f"; did you mean {', '.join(guesses)}?" if guesses else ""
            raise UsageError(f"unrecognized arguments: {' '.join(event.tokens)}{hint}")
        reason = str(getattr(event, "reason", None) or getattr(event, "message", type(event).__name__))
        raise UsageError(f"{flag}: {reason.splitlines()[0].replace('too_few_values', 'expects a value')}")

    with tyro._errors.on_parse_error(one_line):
        args = tyro.cli(Args)
        if args.resume:  # once more, the flags left out taking the checkpoint's values
            saved = read_checkpoint(args.resume)["args"]
            args = tyro.cli(Args, default=Args(**{k: v for k, v in saved.items() if k in Args.__dataclass_fields__}))
    return args


def main() -> None:
    try:
        args = parse_args()
        device = join_process_group(args, validate(args))
        if device.type == "cpu":  # process-wide, so set here rather than inside train(); the ranks share the cores
            per_rank = max(1, available_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            torch.set_num_threads(args.torch_threads or (per_rank if args.num_envs >= THREADED_FROM_ENVS else 1))
        train(args if device.type == "cpu" else replace(args, device=str(device)))
        if dist.is_initialized():
            dist.barrier()  # every rank waits for rank 0's writing: leaving the group early can abort Gloo
    except UsageError as e:
        rank = int(os.environ.get("RANK", "0"))
        if rank != 0:  # under torchrun every rank finds the same error: rank 0 says it once, and torchrun stops
            time.sleep(10)  # this rank when rank 0 exits; a rank still here found an error of its own
        print(f"error: {e}" if rank == 0 else f"error: rank {rank}: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteLossError as e:
        sys.exit(f"error: {e}; lower --learning-rate or --max-grad-norm")
    except KeyboardInterrupt as e:  # a signal, stopped after an iteration (StopRequested), or a second Ctrl-C
        signum = getattr(e, "signum", signal.SIGINT)
        if isinstance(e, StopRequested) and dist.is_initialized():
            dist.barrier()  # all ranks stopped together: wait for rank 0's writing
        if int(os.environ.get("RANK", "0")) == 0:
            written = "a checkpoint, logs" if isinstance(e, StopRequested) else "logs"  # not mid-iteration
            print(f"interrupted by {signal.Signals(signum).name}: {written} and summary.json written (and the model, "
                  "with --save-model)", file=sys.stderr)  # fmt: skip
        sys.exit(128 + signum)  # 130 for SIGINT, 143 for SIGTERM
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
