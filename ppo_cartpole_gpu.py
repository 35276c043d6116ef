"""PPO on a CartPole written in torch tensor ops: thousands of envs, never leaving the device.

The environment, the rollout buffer, GAE, minibatch shuffling and the update all live on one device (`--device cuda`
when a GPU is there, else the CPU): the only host read is one per iteration, for logging.

Run:
    python ppo_cartpole_gpu.py                       # defaults: solves CartPole in seconds on a laptop CPU
    python ppo_cartpole_gpu.py --num-envs 4096       # large batch, throughput mode
    tensorboard --logdir runs

The update (Schulman et al. 2017; "detail N": Huang et al. 2022, "The 37 Implementation Details of PPO"):
    r_t(θ)  = π_θ(a_t|s_t) / π_θold(a_t|s_t)
    δ_t     = r_t + γ (1 - term_t) V(s'_t) - V(s_t)          s'_t: the true next state, also when
    Â_t     = δ_t + γλ (1 - done_t) Â_{t+1}                        the episode was cut at 500 steps
    L_clip  = E[ max(-Â_t r_t(θ), -Â_t clip(r_t(θ), 1-ε, 1+ε)) ]
    L_V     = ½ E[ max((V_θ(s_t) - R_t)², (V_old + clip(V_θ - V_old, -ε, ε) - R_t)²) ],  R_t = Â_t + V_old(s_t)
    L       = L_clip - c_ent H[π_θ] + c_vf L_V

Truncation is not failure: when an episode reaches the 500-step limit we bootstrap from the value of its real last
observation (`info["final_obs"]`) instead of treating it as terminal, which CleanRL's scripts do not do.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from dataclasses import FrozenInstanceError, asdict, dataclass, replace
from datetime import timedelta
from typing import Literal, NamedTuple, Optional

# OpenMP threads that sleep, not spin, while they wait (4x faster on a busy 2-core machine): set before torch loads it
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before a process group exists: docs/running.md, "torchrun"
import torch.nn as nn
import torch.utils._pytree as pytree
import tyro
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

THREADED_FROM_ENVS = 1024  # one torch thread below this many envs (docs/running.md: "Threads and a busy machine")


@dataclass(frozen=True)  # the run's flags, fixed: what changes in training is a tensor (docs/modifying.md)
class Args:
    # Algorithm: a --resume keeps these as the checkpoint has them
    env_id: Literal["CartPole-v1", "EasyCart-v1", "SpinCart-v1"] = "CartPole-v1"
    """the environment: CartPole-v1, EasyCart-v1 (shaped reward) or SpinCart-v1 (spin the pole)"""
    seed: int = 1
    """seed of the networks, the action sampling and the environments"""
    learning_rate: float = 5e-3
    """Adam learning rate (high for PPO: the batches are large and the net small)"""
    num_envs: int = 128
    """parallel environments (per process under torchrun)"""
    num_steps: int = 16
    """steps per environment per rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run (detail 4)"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation (detail 5)"""
    num_minibatches: int = 4
    """minibatches per epoch (detail 6)"""
    update_epochs: int = 4
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch (detail 7)"""
    clip_coef: float = 0.2
    """surrogate clipping coefficient epsilon (detail 8)"""
    clip_vloss: bool = False
    """clip the value loss around the old values (detail 9; off: it slowed CartPole here, cf. Engstrom et al. 2020)"""
    ent_coef: float = 0.0
    """entropy bonus coefficient (detail 10)"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """global gradient-norm clipping (detail 11)"""
    target_kl: Optional[float] = None
    """stop the epochs of an update early once the approximate KL exceeds this (None: never)"""

    # The run's length and its management: a --resume may change these
    total_timesteps: int = 5_000_000
    """upper bound on env steps, all torchrun ranks together (training may stop earlier: `target-return`)"""
    target_return: Optional[float] = 500.0
    """stop once the mean return of the last 100 episodes reaches this (None: never; the shaped envs never reach 500)"""
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """torch device to run everything on (cuda when available, else cpu)"""
    torch_threads: int = 0
    """CPU threads for torch (ignored on GPU); 0: one below 1024 envs (ops too small to share), else one per core"""
    compile: bool = False
    """torch.compile the rollout, batch preparation and gradient step (iteration 1 compiles: not counted in SPS)"""
    cuda_graph: bool = False
    """on a GPU, record an iteration's device work once as a CUDA graph and replay it (docs/running.md: GPU)"""
    num_seeds: int = 1
    """train seeds `seed` .. `seed`+K-1 in this process, their work stacked (vmap): a run folder each, an aggregate"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "rl-ladder"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team); None uses your default"""
    wandb_group: Optional[str] = None
    """the W&B group of the run (--num-seeds: each seed's run in the group of their aggregate folder's name)"""
    capture_video: bool = False
    """every `video-interval` iterations, film whole greedy episodes of 16 new envs (a 4x4 grid MP4)"""
    video_interval: int = 25
    """iterations between two videos, the first at iteration 1 (0: no videos during training)"""
    save_model: bool = False
    """save the agent's weights to the run folder at the end (also on Ctrl-C)"""
    checkpoint_interval: int = 1000
    """iterations between checkpoints to <run folder>/checkpoint.pt (0: only at the end, on Ctrl-C or SIGTERM)"""
    resume: Optional[str] = None
    """a run folder (or its checkpoint.pt) to go on from: omitted flags keep its values; only these run flags change"""
    eval_only: bool = False
    """no training: play `eval-episodes` episodes with the `load-model` weights (filmed with --capture-video)"""
    load_model: Optional[str] = None
    """the weights for --eval-only: a saved .cleanrl_model or a checkpoint.pt"""
    eval_episodes: int = 10
    """greedy-policy episodes evaluated after training (0 skips the evaluation)"""
    progress_bar: bool = True
    """show a live progress bar with SPS, the recent return and the time left"""

    def __post_init__(self):
        """The algorithm's flags checked, for the command line and `Args(...)` in code alike (the run's: `main`)."""
        batch_size, positive = self.num_envs * self.num_steps, ("num_envs", "num_steps", "update_epochs", "num_seeds")
        check_flags(self, {name: (getattr(self, name) > 0, "positive") for name in positive} | {
            "num_minibatches": (self.num_minibatches > 0 and batch_size % self.num_minibatches == 0,
                                f"a divisor of --num-envs * --num-steps = {batch_size}"),
            "total_timesteps": (self.total_timesteps >= batch_size, f"at least one rollout ({batch_size} steps)"),
            "learning_rate": (self.learning_rate > 0, "> 0"),
            "gamma": (0 < self.gamma <= 1, "in (0, 1]"),
            "gae_lambda": (0 <= self.gae_lambda <= 1, "in [0, 1]"),
            "clip_coef": (self.clip_coef > 0, "> 0"),
            "ent_coef": (self.ent_coef >= 0, ">= 0"),
            "vf_coef": (self.vf_coef >= 0, ">= 0"),
            "max_grad_norm": (self.max_grad_norm > 0, "> 0"),
            "target_kl": (self.target_kl is None or self.target_kl > 0, "> 0"),
        })  # fmt: skip


# Environment ----------------------------------------------------------------------------------
class CartPole:
    """Gymnasium's CartPole-v1, vectorised over `num_envs` in float32 torch ops on `device`. Its public attributes and
    methods (reward_threshold None: no "solved" level) are the interface of every env the trainer takes (probes too);
    without state_dict() and load_state_dict() a resumed run's episodes start anew."""

    gravity, masscart, masspole, force_mag = 9.8, 1.0, 0.1, 10.0
    length, tau = 0.5, 0.02  # half the pole's length; seconds between state updates
    total_mass, polemass_length = masscart + masspole, masspole * length
    x_threshold, theta_threshold_radians = 2.4, 12 * 2 * math.pi / 360
    obs_dim, num_actions, max_episode_steps = 4, 2, 500
    reward_threshold: Optional[float] = 475.0  # CartPole-v1's "solved" level for the 100-episode mean

    def __init__(self, num_envs: int, device: torch.device | str = "cpu", seed: int = 0):
        self.num_envs, self.device = num_envs, torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.sync_free_reset = self.device.type != "cpu"  # on a GPU, reading which envs finished stalls: `_autoreset`
        self.state = self.draw_initial_states(num_envs)
        self.episode_return = torch.zeros(num_envs, device=self.device)
        self.episode_length = torch.zeros(num_envs, dtype=torch.int32, device=self.device)

    def draw_initial_states(self, *shape: int) -> torch.Tensor:
        """States uniform in [-0.05, 0.05], (..., n, 4) for `shape` (..., n); feature-major in memory: see `step`."""
        *lead, n = shape
        return torch.empty(*lead, 4, n, device=self.device).uniform_(-0.05, 0.05, generator=self.generator).mT

    def reset(self):
        self.state = self.draw_initial_states(self.num_envs)
        self.episode_return.zero_()
        self.episode_length.zero_()
        return self.state, {}

    def reward_function(self, action: torch.Tensor) -> torch.Tensor:
        """+1 for every step, the one that ends the episode included (as gymnasium)."""
        return torch.ones_like(self.state[:, 0])

    def terminated(self) -> torch.Tensor:
        x, theta = self.state[:, 0], self.state[:, 2]
        return (x.abs() > self.x_threshold) | (theta.abs() > self.theta_threshold_radians)

    def step(self, action: torch.Tensor, initial_states: Optional[torch.Tensor] = None):
        x, x_dot, theta, theta_dot = self.state.unbind(1)
        force = action * (2 * self.force_mag) - self.force_mag  # action 1 pushes right, 0 left
        costheta, sintheta = torch.cos(theta), torch.sin(theta)
        # gymnasium's equations; addcmul(a, b, c, value=v) = a + v*b*c saves kernels
        temp = torch.addcmul(force, theta_dot.square(), sintheta, value=self.polemass_length) / self.total_mass
        denominator = self.length * (4.0 / 3.0 - self.masspole / self.total_mass * costheta.square())
        thetaacc = (self.gravity * sintheta - costheta * temp) / denominator
        xacc = torch.addcmul(temp, thetaacc, costheta, value=-self.polemass_length / self.total_mass)
        # explicit Euler, as gymnasium's default kinematics_integrator="euler". The state is kept feature-major ((4, N)
        # in memory, seen as (N, 4)) so x, x_dot, ... are contiguous rows: faster elementwise ops, ~9x cheaper stacking.
        derivatives = torch.stack((x_dot, xacc, theta_dot, thetaacc))
        self.state = torch.add(self.state.T, derivatives, alpha=self.tau).T
        terminated = self.terminated()
        reward = self.reward_function(action)
        self.episode_return = self.episode_return + reward
        self.episode_length = self.episode_length + 1
        truncated = self.episode_length >= self.max_episode_steps
        info = {"final_obs": self.state, "episode_return": self.episode_return, "episode_length": self.episode_length}
        self._autoreset(terminated | truncated, initial_states)
        return self.state, reward, terminated, truncated, info

    def _autoreset(self, done: torch.Tensor, initial_states: Optional[torch.Tensor]) -> None:
        """Give finished envs fresh initial states, out of place (info["final_obs"] keeps the old)."""
        if initial_states is not None or self.sync_free_reset:  # a state for every env: no host read of `done`
            fresh = self.draw_initial_states(self.num_envs) if initial_states is None else initial_states
            self.state = torch.where(done.unsqueeze(1), fresh, self.state)
        else:  # no stream to stall on the CPU: draw for the finished envs only (~4x cheaper here)
            idx = done.nonzero().squeeze(1)
            self.state = self.state.index_put((idx,), self.draw_initial_states(idx.numel()))
        self.episode_return = self.episode_return.masked_fill(done, 0.0)
        self.episode_length = self.episode_length.masked_fill(done, 0)

    def state_dict(self) -> dict:
        """The states, episode counters and generator, on the CPU (under NCCL a CUDA tensor of rank r would be rebuilt
        in rank 0 on cuda:r), for a checkpoint to go on exactly from."""
        generator = self.generator.get_state()  # and a seed drawn from it, then undrawn: for the other kind of device
        seed = torch.randint(2**62, (), device=self.device, generator=self.generator)
        self.generator.set_state(generator)
        saved = {"state": self.state, "episode_return": self.episode_return, "episode_length": self.episode_length}
        return {k: v.cpu() for k, v in saved.items()} | {"generator": generator, "seed": seed.cpu()}

    def load_state_dict(self, saved: dict) -> torch.Tensor:
        """The envs as `state_dict` saved them; returns their observation (here the state itself)."""
        keys = ("state", "episode_return", "episode_length")
        self.state, self.episode_return, self.episode_length = (saved[k].to(self.device) for k in keys)
        if len(saved["generator"]) == len(self.generator.get_state()):
            self.generator.set_state(saved["generator"])
        else:  # a generator's state is device-specific (CPU: 5,056 bytes, CUDA: 16): go on from the saved seed
            self.generator.manual_seed(int(saved["seed"]))
        return self.state


# Agent ----------------------------------------------------------------------------------------
def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """Orthogonal weights, constant bias (detail 2)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Tanh(nn.Module):
    """tanh; compiled, 2σ(2x) - 1 (equal within 2e-7): inductor's exact tanh costs ~2x as much on a CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * torch.sigmoid(2 * x) - 1 if torch.compiler.is_compiling() else torch.tanh(x)


def mlp(in_dim: int, out_dim: int, out_std: float) -> nn.Sequential:
    """A 64-64 tanh network whose output layer starts at scale `out_std`."""
    return nn.Sequential(layer_init(nn.Linear(in_dim, 64)), Tanh(),
                         layer_init(nn.Linear(64, 64)), Tanh(),
                         layer_init(nn.Linear(64, out_dim), std=out_std))  # fmt: skip


class Agent(nn.Module):
    """Separate 64-64 tanh actor and critic; the actor head starts near uniform (std 0.01)."""

    def __init__(self, obs_dim: int, num_actions: int):
        super().__init__()
        self.critic, self.actor = mlp(obs_dim, 1, out_std=1.0), mlp(obs_dim, num_actions, out_std=0.01)

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def get_action(self, obs: torch.Tensor, gumbel: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Gumbel-max: argmax(logits + `gumbel` noise) samples the softmax in a few kernels; without noise: greedy."""
        logits = self.actor(obs)
        return logits.argmax(-1) if gumbel is None else (logits + gumbel).argmax(-1)

    def forward(self, obs: torch.Tensor, action: torch.Tensor):
        """Log-probability of `action`, entropy, and value."""
        logp = self.actor(obs).log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, action.unsqueeze(-1)).squeeze(-1), entropy, self.get_value(obs)


# Algorithm ------------------------------------------------------------------------------------
class Rollout(NamedTuple):
    """T steps of N envs, preallocated on the device (detail 1: one vectorised batch of envs)."""

    obs: torch.Tensor  # (T, N, obs_dim) the observation each action was chosen on
    actions: torch.Tensor  # (T, N)
    rewards: torch.Tensor  # (T, N)
    terminated: torch.Tensor  # (T, N) the episode failed at this step: no future to bootstrap
    dones: torch.Tensor  # (T, N) terminated or truncated: an episode ended at this step
    final_obs: torch.Tensor  # (T, N, obs_dim) s'_t, the real next state (before any auto-reset)
    episode_return: torch.Tensor  # (T, N) the episode's return so far: its full return where done
    episode_length: torch.Tensor  # (T, N)

    @staticmethod
    def empty(num_steps: int, num_envs: int, obs_dim: int, device: torch.device) -> Rollout:
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(num_steps, num_envs, *shape, dtype=dtype, device=device)
        return Rollout(zeros(obs_dim), zeros(dtype=torch.long), zeros(), zeros(dtype=torch.bool),
                       zeros(dtype=torch.bool), zeros(obs_dim), zeros(), zeros(dtype=torch.int32))  # fmt: skip


class RolloutNoise(NamedTuple):
    """A rollout's random numbers, drawn before it: `collect_rollout` is then pure tensor code, one compiled graph."""

    gumbel: torch.Tensor  # (T, N, num_actions) Gumbel noise, -log(Exp(1)), for sampling the actions
    initial_states: torch.Tensor  # (T, N, obs_dim) where an env restarts if its episode ends at step t

    @staticmethod
    def draw(envs, num_steps: int) -> RolloutNoise:
        """The Gumbel noise from torch's global generator (seeded by --seed), the states from the env's own."""
        gumbel = -torch.empty(num_steps, envs.num_envs, envs.num_actions, device=envs.device).exponential_().log()
        return RolloutNoise(gumbel, envs.draw_initial_states(num_steps, envs.num_envs))


class Batch(NamedTuple):
    """A rollout flattened to T*N samples, with what the loss needs."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor  # log π_old(a|s)
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor  # V_old(s)


def collect_rollout(agent: Agent, envs, obs: torch.Tensor, rollout: Rollout, noise: RolloutNoise) -> torch.Tensor:
    """Step every env T times with the current policy, filling `rollout`; return the next observation."""
    with torch.no_grad():
        for t in range(len(rollout.obs)):
            rollout.obs[t] = obs
            action = agent.get_action(obs, noise.gumbel[t])
            obs, reward, terminated, truncated, info = envs.step(action, noise.initial_states[t])
            rollout.actions[t], rollout.rewards[t], rollout.terminated[t] = action, reward, terminated
            rollout.dones[t], rollout.final_obs[t] = terminated | truncated, info["final_obs"]
            rollout.episode_return[t], rollout.episode_length[t] = info["episode_return"], info["episode_length"]
    return obs


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
    advantages, returns = compute_gae(rollout.rewards, values.view(T, N), next_values, rollout.terminated,
                                      rollout.dones, args.gamma, args.gae_lambda)  # fmt: skip
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
    stats = {"losses/policy_loss": pg_loss, "losses/value_loss": v_loss, "losses/entropy": entropy_loss,
             "losses/approx_kl": approx_kl, "losses/clipfrac": clipfrac, "losses/total_loss": loss}  # fmt: skip
    return loss, {tag: value.detach() for tag, value in stats.items()}


def gradient_step(agent: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, args, batch, idx=None) -> dict:
    """One optimizer step on `loss_fn(agent, args, minibatch)`, the minibatch being the rows `idx` of `batch` (all of
    it when None), with global gradient-norm clipping (detail 11); returns the loss statistics."""
    loss, stats = loss_fn(agent, args, batch if idx is None else type(batch)(*(x[idx] for x in batch)))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    average_gradients(agent)  # data parallel under torchrun
    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return stats


def average_gradients(module: nn.Module) -> None:
    """Under torchrun each gradient of `module` becomes the ranks' mean, in one all-reduce (in one process: nothing).
    Call it between `backward()` and `step()` for a network you train besides the agent, or its ranks drift apart."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    for grad, mean in zip(grads, mean_over_ranks(grads)):
        grad.copy_(mean)  # in one process the same tensor: a no-op


def mean_over_ranks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's mean over the torchrun ranks, all in one all-reduce (the tensors themselves in one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensors
    flat = torch.cat([t.detach().flatten() for t in tensors])
    dist.all_reduce(flat)
    return [m.view_as(t) for t, m in zip(tensors, (flat / dist.get_world_size()).split([t.numel() for t in tensors]))]


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """1 - Var[R - V] / Var[R], the share of the returns' variance the critic explains; NaN (as CleanRL) for flat R."""
    var_returns = returns.var()
    return torch.where(var_returns == 0, torch.nan, 1 - (returns - values).var() / var_returns)


def update(step, batch: Batch, args: Args) -> dict[str, torch.Tensor]:
    """`update-epochs` passes over the batch in shuffled minibatches (detail 6), a gradient `step(batch, idx)` on each,
    ending early once the approximate KL exceeds `target-kl`; returns the mean loss statistics, explained variance."""
    history = []
    for _ in range(args.update_epochs):
        for idx in torch.randperm(len(batch.actions), device=batch.actions.device).tensor_split(args.num_minibatches):
            history.append(step(batch, idx))
        # a host read per epoch; under torchrun the ranks judge their mean KL, so they stop together
        if args.target_kl is not None and mean_over_ranks([history[-1]["losses/approx_kl"]])[0] > args.target_kl:
            break
    means = {tag: torch.stack([stats[tag] for stats in history]).mean() for tag in history[0]}
    return means | {"losses/explained_variance": explained_variance(batch.values, batch.returns)}


def train(args: Args, envs=None) -> Agent:
    """Train PPO on `envs` (default: the `--env-id` env) and return the agent. Any env with the CartPole interface
    works, e.g. the tests' probe envs. `Run` writes the outputs, also when an exception ends the run."""
    device, T, N = torch.device(args.device), args.num_steps, args.num_envs
    with Run(args) as run:
        # --total-timesteps counts all ranks' steps; --eval-only trains not at all (Run evaluates at the end)
        num_iterations = 0 if args.eval_only else args.total_timesteps // (T * N * run.world_size)
        torch.manual_seed(args.seed + run.rank)  # under torchrun each rank samples its own actions
        envs = make_envs(args, device, envs, run.rank)
        agent = Agent(envs.obs_dim, envs.num_actions).to(device)  # `run.start` gives every rank rank 0's weights
        # eps 1e-5: detail 3; the fused kernel is ~3x faster than the per-tensor loop on a small net
        optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
        initial_lrs = [group["lr"] for group in optimizer.param_groups]  # each group anneals from its own
        rollout = Rollout.empty(T, N, envs.obs_dim, device)
        # with --resume: agent, optimizer, envs, RNGs and counters as the checkpoint left them; state you add goes in
        # by name, e.g. run.start(..., kl_coef=kl_coef): a tensor (changed in place) or an object with a state_dict()
        obs = run.start(agent, envs, optimizer, num_iterations * T * N * run.world_size, envs.reset()[0])
        # the hot phases as written, or compiled with --compile: built on the restored state, after `run.start`
        collect, prepare, step = hot_phases(agent, optimizer, ppo_loss, args, collect_rollout, make_batch)

        def one_iteration(obs, noise, rollout):  # its device work: on a GPU one CUDA graph (--cuda-graph) of all three
            obs = collect(agent, envs, obs, rollout, noise)  # phases; the rollout it fills given, as each seed has one
            return obs, update(step, prepare(agent, rollout, args), args)

        iterate = cuda_graph(one_iteration, run, optimizer, envs, agent)  # `envs` and `agent` hold state it changes
        for iteration in range(run.counters["iteration"] + 1, num_iterations + 1):
            for group, lr in zip(optimizer.param_groups, initial_lrs) if args.anneal_lr else ():
                group["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * lr
            obs, stats = iterate(obs, RolloutNoise.draw(envs, T), rollout)
            if run.log(T * N, stats, rollout):  # True once the target return is reached
                break
    return agent


# What train() and the run management call: env variants, episodes, evaluation, videos
class EasyCart(CartPole):
    """Shaped reward in [0, 1]: half for an upright pole, half for a centred cart."""

    reward_threshold = None

    def reward_function(self, action: torch.Tensor) -> torch.Tensor:
        x, theta = self.state[:, 0], self.state[:, 2]
        upright = 1.0 - theta.abs() / self.theta_threshold_radians
        centred = 1.0 - x.abs() / self.x_threshold
        return (0.5 * (upright + centred)).clamp(0.0, 1.0)


class SpinCart(CartPole):
    """Reward for spinning the pole fast with the cart centred and slow; the pole may turn all the way round."""

    reward_threshold = None

    def reward_function(self, action: torch.Tensor) -> torch.Tensor:
        x, x_dot, theta_dot = self.state[:, 0], self.state[:, 1], self.state[:, 3]
        spin = (0.1 * theta_dot.abs()).clamp(max=1.0)
        drift = (x / self.x_threshold).abs() + (x_dot / 10.0).abs()
        return spin - 0.5 * drift.clamp(max=1.0)

    def terminated(self) -> torch.Tensor:
        return self.state[:, 0].abs() > self.x_threshold


def make_envs(args: Args, device: torch.device, envs=None, rank: int = 0):
    """The `--env-id` envs (seeded per torchrun rank), or the given `envs` (e.g. a probe) checked against the flags."""
    if envs is None:
        env_class = {"CartPole-v1": CartPole, "EasyCart-v1": EasyCart, "SpinCart-v1": SpinCart}[args.env_id]
        envs = env_class(args.num_envs, device, args.seed + rank)
    if envs.num_envs != args.num_envs:
        raise UsageError(f"the env has {envs.num_envs} envs but --num-envs is {args.num_envs}")
    if args.capture_video and not isinstance(envs, CartPole):  # `draw` pictures a cart and a pole
        raise UsageError(f"--capture-video draws CartPole states; {type(envs).__name__} is not a CartPole")
    return envs


def finished_episodes(rollout: Rollout):
    """(ended, return, length), tensors of one shape: the episodes that ended during `rollout`."""
    return rollout.dones, rollout.episode_return, rollout.episode_length


def evaluate(agent: Agent, envs, args: Args, video: Optional[str], num_envs: Optional[int] = None) -> list[float]:
    """The return of one whole episode in each of `eval-episodes` (or `num_envs`) fresh envs under the greedy (argmax)
    policy; with a `video` path, a grid video there of (up to 16 of) them, a frame per step, each held still once its
    episode ends."""
    envs = type(envs)(num_envs or args.eval_episodes, envs.device, args.seed + 1)
    obs, _ = envs.reset()
    returns, frames = torch.full((envs.num_envs,), float("nan"), device=envs.device), []
    with torch.no_grad():
        for _ in range(envs.max_episode_steps):
            playing = returns[:16].isnan().unsqueeze(1)
            frames.append(torch.where(playing, obs[:16], frames[-1]) if frames else obs[:16])
            obs, _, terminated, truncated, info = envs.step(agent.get_action(obs))  # greedy: no Gumbel noise
            returns = torch.where((terminated | truncated) & returns.isnan(), info["episode_return"], returns)
            if not returns.isnan().any():
                break
    if video is not None:
        grid_video(video, torch.stack(frames), fps=round(1 / envs.tau))  # real time: 50 fps
    return returns.tolist()


def record_video(agent: Agent, envs, rollout: Rollout, args: Args, path: str) -> str:
    """Whole episodes of the policy as it is now, greedy, in 16 new envs (the same 16 at every video, so they show what
    training changed), as `evaluate` films them at `path`; returns the path. Training's envs go on undisturbed."""
    evaluate(agent, envs, args, path, num_envs=16)
    return path


def draw(states: torch.Tensor, width: int = 150, height: int = 100) -> torch.Tensor:
    """CartPole states (..., 4) as RGB frames (..., height, width, 3) uint8 in tensor ops: gymnasium's picture (track,
    black cart, brown pole, blue axle) scaled from its 600x400 screen, without pygame."""
    s = states.reshape(-1, 4, 1, 1).float()  # a state's numbers broadcast over its frame's pixels
    unit, scale = width / 600.0, width / (2 * CartPole.x_threshold)  # gymnasium draws on a 600-pixel-wide screen
    cart_w, cart_h, pole_w, pole_len = 50 * unit, 30 * unit, 10 * unit, scale * 2 * CartPole.length
    track_y = height * 0.75
    ys = torch.arange(height, device=s.device, dtype=torch.float32).view(height, 1) + 0.5
    xs = torch.arange(width, device=s.device, dtype=torch.float32) + 0.5
    cart_x, sin, cos = s[:, 0] * scale + width / 2, torch.sin(s[:, 2]), torch.cos(s[:, 2])
    # distance of each pixel from the pole's axis segment, from the axle to the tip
    px, py = xs - cart_x, track_y - cart_h / 4 - ys  # pixel relative to the axle, y up
    along = (px * sin + py * cos).clamp(0.0, pole_len)
    pole = (px - along * sin).square() + (py - along * cos).square() <= (pole_w / 2) ** 2
    cart = (px.abs() <= cart_w / 2) & (ys >= track_y - cart_h / 2) & (ys <= track_y + cart_h / 2)
    axle = px.square() + py.square() <= (pole_w / 2) ** 2
    track = (ys - track_y).abs() <= 0.5
    frame = torch.full((s.shape[0], height, width, 3), 255, dtype=torch.uint8, device=s.device)
    for mask, colour in ((track.expand_as(cart), (0, 0, 0)), (cart, (0, 0, 0)), (pole, (202, 152, 101)),
                         (axle, (129, 132, 203))):  # fmt: skip
        frame[mask] = torch.tensor(colour, dtype=torch.uint8, device=s.device)
    return frame.view(*states.shape[:-1], height, width, 3)


def grid_video(path: str, obs: torch.Tensor, fps: int) -> str:
    """An MP4 at `path` of up to 16 envs of CartPole observations (T, N, 4), a frame per step, tiled as squarely as they
    fit without a wasted row (10 envs: 3x4, 16: 4x4); returns the path."""
    frames = draw(obs[:, :16])  # (T, n, h, w, 3)
    t, n, h, w, _ = frames.shape
    rows, cols = math.isqrt(n), -(-n // math.isqrt(n))
    if n < rows * cols:  # blank tiles fill the last row
        frames = torch.cat((frames, frames.new_full((t, rows * cols - n, h, w, 3), 255)), dim=1)
    frames[:, :, [0, -1]] = 128  # thin grey border between tiles
    frames[:, :, :, [0, -1]] = 128
    frames = frames.view(t, rows, cols, h, w, 3).permute(0, 1, 3, 2, 4, 5).reshape(t, rows * h, cols * w, 3)
    with video_writer(path, fps) as writer:
        for frame in frames.cpu().numpy():
            writer.append_data(frame)
    return path


def check_flags(args, rules: dict[str, tuple[bool, str]]) -> None:
    """UsageError for the first flag of `{name: (ok, rule)}` that breaks its rule or is not a finite number."""
    for name, (ok, rule) in rules.items():
        value = getattr(args, name)
        if not ok or (isinstance(value, float) and not math.isfinite(value)):
            raise UsageError(f"--{name.replace('_', '-')} must be {rule}, got {value}")


def video_writer(path: str, fps: int):
    """An MP4 writer (imageio's ffmpeg, H.264): `append_data(frame)` for each RGB frame (H, W, 3) uint8, then close."""
    import imageio.v2 as imageio

    os.makedirs(os.path.dirname(path), exist_ok=True)
    return imageio.get_writer(path, fps=fps, macro_block_size=2)  # odd sides padded to even, as H.264 needs


# Fast paths: compile, one CUDA graph per iteration, K seeds stacked; identical in the four tensor scripts
class LossOf(nn.Module):
    """`loss_fn(agent, args, minibatch)` as a module whose parameters torch.func.functional_call swaps: the loss gets
    the real Agent compiled too."""

    def __init__(self, agent: nn.Module, loss_fn, args):
        super().__init__()
        self.agent, self.loss_fn, self.args = agent, loss_fn, args

    def forward(self, minibatch):
        return self.loss_fn(self.agent, self.args, minibatch)


def functional_gradient_step(agent: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, args):
    """`gradient_step` as one pure function of (lr, batch, idx) that torch.compile makes a single graph (it cuts
    `backward()` and `step()` apart: 3x slower here) and torch.func.vmap stacks over seeds: torch.func.grad's
    gradients, clipped, in plain Adam's update written out on the optimizer's own state and settings (built after
    `run.start` has loaded them). The parameters and state are read at each call: `Seeds` swaps in the stacked ones."""
    group, loss_of = optimizer.param_groups[0], LossOf(agent, loss_fn, args)
    (beta1, beta2), eps = group["betas"], group["eps"]
    for p in loss_of.parameters():
        if not optimizer.state[p]:  # what torch.optim.Adam creates at its first step
            optimizer.state[p].update(step=torch.zeros((), device=p.device), exp_avg=torch.zeros_like(p),
                                      exp_avg_sq=torch.zeros_like(p))  # fmt: skip
    states = [optimizer.state[p] for p in loss_of.parameters()]

    def step(lr, batch, idx=None):
        minibatch = batch if idx is None else type(batch)(*(x[idx] for x in batch))  # gathered inside the graph
        params = dict(loss_of.named_parameters())
        loss = lambda p, mb: torch.func.functional_call(loss_of, p, (mb,))
        grads, stats = torch.func.grad(loss, has_aux=True)(params, minibatch)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        clip = (args.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for p, g, s in zip(params.values(), grads.values(), states):  # s: the optimizer's state as it is now
                g = g * clip
                s["step"] += 1
                s["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)  # m = β1 m + (1 - β1) g (vmap has no lerp_ rule)
                s["exp_avg_sq"].mul_(beta2).add_(g * g, alpha=1 - beta2)  # v = β2 v + (1 - β2) g²
                denom = (s["exp_avg_sq"] / (1 - beta2 ** s["step"])).sqrt() + eps
                p.sub_(lr / (1 - beta1 ** s["step"]) * s["exp_avg"] / denom)
        return stats

    return step


def writes_out(agent: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether `functional_gradient_step` can take the step: plain Adam in one param group (what it writes out), no
    parameter in two places (torch.func.grad cannot, compiled) and one process (it does not all-reduce)."""
    group, uses = optimizer.param_groups[0], len(list(agent.named_parameters(remove_duplicate=False)))
    plain = len(optimizer.param_groups) == 1 and not any(group.get(k) for k in ("weight_decay", "amsgrad", "maximize"))
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    return type(optimizer) is torch.optim.Adam and plain and uses == len(list(agent.parameters())) and alone


def hot_phases(agent: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, args, *phases):
    """`phases` (functions of tensors) and `step(batch, idx)`, one gradient step: as written, or with --compile each
    compiled into a single graph (`compiled`); with --num-seeds the step written out, as vmap cannot run backward()."""
    stacked = Seeds.current is not None
    if not args.compile and not stacked:
        return *phases, functools.partial(gradient_step, agent, optimizer, loss_fn, args)
    if stacked and not writes_out(agent, optimizer):
        name = type(optimizer).__name__  # what functional_gradient_step writes out, vmap being unable to run backward()
        raise UsageError(f"--num-seeds: the stacked seeds take plain Adam's step (one param group, no weight decay), "
                         f"not {name}'s as set here; see docs/modifying.md#many-seeds")  # fmt: skip
    if args.compile:  # random ops (dropout) draw as eager ones do: the same numbers
        torch._inductor.config.fallback_random = True
    if not writes_out(agent, optimizer):  # the loss's forward and backward compiled, then the optimizer's own step()
        return *map(compiled, phases), functools.partial(gradient_step, agent, optimizer, compiled(loss_fn), args)
    build = compiled if args.compile and not stacked else lambda fn: fn  # noqa: E731 (`Seeds` compiles what it stacks)
    step, device = build(functional_gradient_step(agent, optimizer, loss_fn, args)), next(agent.parameters()).device
    group = optimizer.param_groups[0]  # (the dict: dynamo, seeing the optimizer in a graph, would set it capturable)

    def functional_step(*batch_idx):  # the rate as the param group has it now (--resume replaced the groups before),
        lr = group["lr"]  # in a tensor: as a float it would be a constant, compiled again at every iteration
        return step(lr if torch.is_tensor(lr) else torch.tensor(lr, device=device), *batch_idx)

    return *map(build, phases), functional_step


def compiled(fn):
    """torch.compile'd `fn` as one graph (fullgraph: a break is an error, not a silent slowdown); what stops it ends
    the run in one line (a host read, a branch on a tensor's value, a value changing at every call)."""
    graph = torch.compile(fn, fullgraph=True)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return graph(*args, **kwargs)
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            cause, where = lines[0], [f" ({line})" for line in lines if line.startswith("File ")][-1:]  # your line
            if isinstance(e, torch._dynamo.exc.FailOnRecompileLimitHit):  # dynamo's last reason: the guard that failed
                reasons = max(torch._dynamo.utils.guard_failures.values(), key=len, default=[])
                guard = " ".join(reasons[-1].split("User stack trace")[0].split()) if reasons else "a value changed"
                cause = f"it compiles again at every call, as {guard}"
            raise UsageError(f"--compile: {cause}{''.join(where)}; see docs/modifying.md#compiled-graphs") from None

    return call


class HostWatch(torch.overrides.TorchFunctionMode):
    """Call 1's watch (eager code only: dynamo would trace a mode) for the first torch call that waits for the host or
    mixes a CPU tensor (a scalar) into CUDA ones: a recording cannot hold the one and would keep the other's value."""

    def __init__(self, graph):
        super().__init__()
        self.graph = graph

    def __torch_function__(self, func, types, args=(), kwargs=None):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = func(*args, **(kwargs or {}))
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        devices = {x.device.type for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        if (syncs or {"cpu", "cuda"} <= devices) and not self.graph.reason:  # where: the innermost line not torch's
            torch_dir = os.path.dirname(torch.__file__)
            here = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(torch_dir)]
            why = "it waits for the host" if syncs else "a CPU tensor meets CUDA ones"
            self.graph.reason = f"{why} at {here[-1].filename}:{here[-1].lineno}"
        for w in caught if not syncs else ():
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return out


def cuda_graph(fn, run, optimizer: Optional[torch.optim.Optimizer], *holders):
    """`fn` as a `CudaGraph` on a GPU (with --no-cuda-graph: run the same way, never recorded), else `fn` itself; with
    --num-seeds, one call of it for all the seeds (`Seeds`, a CUDA graph on a GPU)."""
    if Seeds.current is not None:
        return Seeds.current.join(fn, run, optimizer, holders)
    return CudaGraph(fn, run, optimizer, holders) if run.device.type == "cuda" else fn


class CudaGraph:
    """`fn` (tensors in and out: an iteration's device work) recorded once as a CUDA graph: its thousands of launches
    from Python become one. Call 1 runs it as written, watching for host reads; call 2 records it; every call replays
    it on the memory recorded (inputs and the tensors it leaves on `holders` copied in, outputs cloned). What cannot
    be recorded runs as written, with a note. Python values are replayed as recorded: what changes must be a tensor."""

    def __init__(self, fn, run, optimizer, holders):
        self.fn, self.run, self.replay, self.calls = fn, run, None, 0
        tables = [m._buffers for h in holders if isinstance(h, nn.Module) for m in h.modules()]
        tables += [vars(h) for h in holders if not isinstance(h, nn.Module)]  # an env's state, a module's buffers
        self.slots = [(table, k) for table in tables for k, v in table.items() if torch.is_tensor(v)]
        capturable = optimizer is None or "capturable" in optimizer.defaults
        self.groups = optimizer.param_groups if optimizer and capturable and run.device.type == "cuda" else []
        self.lrs = [torch.zeros((), device=run.device) for _ in self.groups]
        self.reason = None if run.args.cuda_graph else ""  # None: to be recorded; "": not, silently
        if self.reason is None and not capturable:
            self.reason = f"{type(optimizer).__name__} has no capturable mode"
        elif self.reason is None and run.world_size > 1:
            self.reason = "under torchrun the gradients' all-reduce is not recorded"

    def __call__(self, *args):
        self.calls += 1
        leaves, spec = pytree.tree_flatten(args)
        if self.calls == 2 and self.reason is None:
            self.start_recording(leaves, spec)
        if self.reason:  # said once
            self.run.note(f"--cuda-graph: {self.fn.__name__} runs as written, not as a CUDA graph: {self.reason}")
            self.reason = ""
        fits = lambda x, static: x.shape == static.shape if torch.is_tensor(x) else x is static  # noqa: E731
        if self.replay is None or not all(map(fits, leaves, self.static)):
            first = self.calls == 1 and self.reason is None and self.run.device.type == "cuda"
            with self.rates(), self.warm_up() if first else contextlib.nullcontext():
                return self.fn(*args)
        for lr, group in zip(self.lrs, self.groups):
            lr.fill_(group["lr"])
        for x, static in zip(leaves, self.static):
            if torch.is_tensor(x) and x is not static:
                static.copy_(x)
        self.hold()
        out = self.replay()
        for x, static in zip(leaves, self.static):  # what `fn` wrote into its inputs (not into an env's state held)
            if torch.is_tensor(x) and x is not static and not any(x is held for held in self.static_slots):
                x.copy_(static)
        return pytree.tree_map(lambda x: x.clone() if torch.is_tensor(x) else x, out)

    def hold(self) -> None:
        """The holders' tensors, where new ones replaced them (`fn` out of place, a reset), copied into the recorded."""
        for (table, k), static in zip(self.slots, self.static_slots):
            if table[k] is not static:
                table[k] = static.copy_(table[k])

    @contextlib.contextmanager
    def rates(self):
        """Learning rates as device tensors, as a replay reads them (and fused Adam rounds: recorded or not, alike)."""
        saved = [(group["lr"], group["capturable"]) for group in self.groups]
        for group, lr in zip(self.groups, self.lrs):
            group["lr"], group["capturable"] = lr.fill_(group["lr"]), True
        try:
            yield
        finally:
            for group, (lr, capturable) in zip(self.groups, saved):
                group["lr"], group["capturable"] = lr, capturable

    @contextlib.contextmanager
    def warm_up(self):
        """Call 1 on a side stream, as recordings need; a host read in it (torch's own, compiling, aside) stops one."""
        (stream := torch.cuda.Stream()).wait_stream(torch.cuda.current_stream())
        torch.cuda.set_sync_debug_mode("warn")
        try:
            watch = contextlib.nullcontext() if self.run.args.compile else HostWatch(self)
            with torch.cuda.stream(stream), warnings.catch_warnings(record=True) as caught, watch:
                warnings.simplefilter("always")
                yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.current_stream().wait_stream(stream)
        for w in caught:
            if "synchroniz" not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            elif not w.filename.startswith(os.path.dirname(torch.__file__)):
                self.reason = self.reason or f"it waits for the host at {w.filename}:{w.lineno}"

    def start_recording(self, leaves, spec) -> None:
        """Call 2: `fn` recorded on copies of the inputs and on the holders' tensors as they are (no work is done)."""
        start, saved = time.perf_counter(), [(table, k, table[k]) for table, k in self.slots]
        # an input that is one of the holders' tensors (the obs a reset returned) stays that tensor, as in the warm-up:
        # compiled code is specialised on which inputs alias, and would compile again inside the recording (and fail)
        self.static_slots = held = [v for *_, v in saved]
        self.static = [x if any(x is v for v in held) or not torch.is_tensor(x) else x.clone() for x in leaves]
        cuda = self.run.device.type == "cuda"  # a failed recording leaves torch's CUDA generator unusable: a clone
        generator = torch.cuda.default_generators[self.run.device.index or 0] if cuda else None
        rng = generator.clone_state() if cuda else None

        def body():
            out = self.fn(*pytree.tree_unflatten(self.static, spec))
            self.hold()  # recorded too: a replay leaves the new state where the next one reads it
            return out

        try:
            with self.rates():
                self.replay = self.record(body)
        except Exception as e:  # a host read or a CPU tensor during the recording, an op CUDA graphs cannot hold
            for table, k, v in saved:
                table[k] = v
            if cuda:
                generator.graphsafe_set_state(rng)
            while e.__context__ is not None:  # the first error: the others followed from it
                e = e.__context__
            self.reason = f"recording it failed ({(str(e).strip() or type(e).__name__).splitlines()[0][:200]})"
            return
        seconds = time.perf_counter() - start
        self.run.clock, self.run.setup_seconds = self.run.clock + seconds, self.run.setup_seconds + seconds
        self.run.note(f"--cuda-graph: recorded {self.fn.__name__} as one CUDA graph in {seconds:.2f} s, not counted")

    def record(self, body):
        """`body`'s kernels recorded as a CUDA graph (nothing runs); returns its replay (the CPU tests: `body`)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = body()
        return lambda: graph.replay() or out  # replay() returns None


def train_seeds(train, args) -> list:
    """`train(args)`, or --num-seeds K > 1 seeds in this process (`Seeds`): a run folder each, their aggregate."""
    return [train(args)] if args.num_seeds == 1 else Seeds(args).train(train)


class Seeds:
    """--num-seeds K: `train` as written, for each seed in a thread of its own. The threads take turns (one runs at a
    time, with its own torch RNG state), so each is one seed's run; a function given to `cuda_graph` waits until every
    seed has called it, then runs once for all: torch.func.vmap over their stacked tensors (the holders' parameters,
    buffers and attributes, the optimizer's state and rate, the inputs), the results handed back to each seed."""

    current: Optional[Seeds] = None  # while K seeds train

    def __init__(self, args):
        if dist.is_initialized():
            raise UsageError("--num-seeds stacks the seeds in one process: under torchrun, use --num-seeds 1")
        k, first = args.num_seeds, args.seed  # with --resume/--load-model: the K seeds' folders, from their aggregate
        dirs = (read_summary(args.resume or args.load_model) or {}).get("run_dirs")
        if (args.resume or dirs) and len(dirs or []) != k:
            flag = "--resume" if args.resume else "--load-model"
            raise UsageError(f"{flag} with --num-seeds {k} takes the aggregate folder of {k} seeds (runs/..__{first}-"
                             f"{first + k - 1}__..), or --load-model one model for all")  # fmt: skip
        self.dir = args.resume or os.path.join("runs", f"{args.env_id}__{args.exp_name}__{first}-{first + k - 1}__"
                                                       f"{int(time.time())}")  # fmt: skip
        group = args.wandb_group or os.path.basename(os.path.normpath(self.dir))  # --track: a W&B run per seed
        self.args = [replace(args, seed=first + i, num_seeds=1, resume=args.resume and dirs[i], wandb_group=group,
                             load_model=dirs[i] if dirs and args.load_model else args.load_model,
                             capture_video=args.capture_video and i == 0, progress_bar=args.progress_bar and i == 0)
                     for i in range(k)]  # fmt: skip
        self.flags, self.dirs = args, list(dirs) if args.resume else [None] * k
        ended = {i for i, d in enumerate(self.dirs) if d and finished(d, args)}  # --resume: a seed whose run has ended
        self.live, self.pending, self.results, self.errors = set(range(k)) - ended, {}, {}, {}
        if args.resume and not self.live:  # as `Run.start` says for one seed
            raise UsageError(f"--resume {args.resume}: each seed has ended; raise --total-timesteps or --target-return")
        self.cond, self.local, self.abort = threading.Condition(), threading.local(), False
        self.turn = min(self.live, default=0)  # the seed whose Python runs now
        self.entries, self.runs, self.agents = [[] for _ in range(k)], [None] * k, [None] * k
        self.rngs, self.calls, self.signal = [None] * k, {}, 0

    def train(self, train) -> list:
        """Run the K seeds to their ends; write and print their aggregate; raise the first seed's error, if any."""
        Seeds.current, main = self, threading.current_thread() is threading.main_thread()
        threads = [threading.Thread(target=self.seed, args=(i, train), name=f"seed {a.seed}", daemon=True)
                   for i, a in enumerate(self.args) if i in self.live]  # fmt: skip
        handlers = {s: signal.signal(s, self.stop) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():  # in short waits: the signal handler runs in between
                    try:
                        thread.join(0.1)
                    except KeyboardInterrupt:  # a second Ctrl-C: every seed stops at once
                        with self.cond:
                            self.abort = True
                            self.cond.notify_all()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            Seeds.current = None
        self.write(final=True)
        for i in sorted(self.errors):
            raise self.errors[i]
        return self.agents

    def stop(self, signum: int, frame) -> None:
        """SIGINT/SIGTERM: every seed stops after the same iteration (the next stacked call), with a checkpoint."""
        self.signal = self.signal or signum
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the next Ctrl-C raises KeyboardInterrupt
        tqdm.write(f"note: {signal.Signals(signum).name}: stopping after this iteration (Ctrl-C again: at once)")

    def seed(self, i: int, train) -> None:
        """Thread i: seed i's `train`, in its turns."""
        self.local.i = i
        try:
            with self.cond:
                self.cond.wait_for(lambda: self.turn == i or self.abort)
            if self.abort:
                raise KeyboardInterrupt
            self.agents[i] = train(self.args[i])
        except BaseException as e:  # its Run has written its outputs
            self.errors[i] = e
        finally:
            with self.cond:
                self.live.discard(i)
                self.hand_on(i)

    def join(self, fn, run, optimizer, holders):
        """What `cuda_graph` returns under --num-seeds: `fn` called for every seed at once."""
        i = self.local.i
        for name in [k for k, v in run.stateful.items() if torch.is_tensor(v)][:1]:  # read as seed 1's by all seeds
            raise UsageError(f"--num-seeds: run.start({name}=...), a tensor, cannot be each seed's own in the stacked "
                             "call: make it a buffer of the agent (docs/modifying.md#many-seeds)")  # fmt: skip
        self.entries[i].append((fn, optimizer, holders))
        self.runs[i], j = run, len(self.entries[i]) - 1

        @functools.wraps(fn)
        def call(*args):
            with self.cond:
                self.rngs[i], self.pending[i] = rng_state(), (j, args)
                self.hand_on(i)
                self.cond.wait_for(lambda: self.turn == i or self.abort)
                if self.abort:
                    raise KeyboardInterrupt
                rng_state(self.rngs[i])
                out = self.results.pop(i)
            if isinstance(out, BaseException):
                raise out
            return out

        return call

    def hand_on(self, i: int) -> None:
        """Seed i waits or has ended: the next seed in order runs; when all wait, their calls run (in this thread)."""
        waiting = [k for k in sorted(self.live) if k not in self.pending]
        if not waiting and self.pending:
            self.write(final=False)
            calls, self.pending, lead = self.pending, {}, min(self.pending)
            for run in filter(None, self.runs):  # a signal: every seed stops after this iteration
                run.stop_signal = run.stop_signal or self.signal
            rng_state(self.rngs[lead])  # the calls draw (minibatch orders, dropout) from the first seed's stream,
            for j in sorted({j for j, _ in calls.values()}):
                seeds = [k for k in sorted(calls) if calls[k][0] == j]
                try:
                    self.results.update(zip(seeds, self.stacked(j, seeds, [calls[k][1] for k in seeds])))
                except Exception as e:  # every seed in the call raises it
                    self.results.update((k, e) for k in seeds)
            self.rngs[lead] = rng_state()  # which its checkpoints keep
            waiting = sorted(self.live)
        self.turn = next((k for k in waiting if k > i), waiting[0] if waiting else None)
        self.cond.notify_all()

    def stacked(self, j: int, seeds: list[int], calls: list[tuple]) -> list:
        """The j-th function the seeds gave `cuda_graph`, called once on their stacked tensors; each seed's results."""
        entries = [self.entries[k][j] for k in seeds]
        slots = [stack_slots(optimizer, holders) for _, optimizer, holders in entries]
        flat = [pytree.tree_flatten(args) for args in calls]
        if any(len(s) != len(slots[0]) for s in slots) or any(spec != flat[0][1] for _, spec in flat):
            raise UsageError(f"--num-seeds: the seeds' {entries[0][0].__name__} differ in their state or arguments")
        where = [n for n, x in enumerate(flat[0][0]) if torch.is_tensor(x)]
        device = self.runs[seeds[0]].device
        values = [torch.stack([torch.as_tensor(get_slot(t, key), device=device) for t, key in column])
                  for column in zip(*slots)]  # fmt: skip
        inputs = [torch.stack([leaves[n] for leaves, _ in flat]) for n in where]
        key = (j, tuple(seeds))
        if key not in self.calls:
            self.calls[key] = self.vmapped(entries, slots[0], flat[0], where)
        out, new = self.calls[key](values, inputs)
        with torch.no_grad():  # what the call wrote, into the seeds' own tensors (in place: a Parameter is known by
            for n, seed_slots in enumerate(slots):  # its identity), inputs first: one may be a holder's tensor
                for m, value in zip(where, inputs):
                    flat[n][0][m].copy_(value[n])
                for (t, name), value in zip(seed_slots, new):
                    mine = get_slot(t, name)
                    if not torch.is_tensor(mine):  # a rate given as a float: the call only read it
                        continue
                    fits = mine.shape == value[n].shape and mine.dtype == value[n].dtype
                    mine.copy_(value[n]) if fits else set_slot(t, name, value[n].clone())
        return [pytree.tree_map(lambda x, n=n: x[n], out) for n in range(len(seeds))]

    def vmapped(self, entries, slots, flat, where):
        """The first seed's function on all the seeds' tensors: its slots set to the stacked ones (vmap shows each as
        one seed's) while it runs, the inputs written in place; with --compile one graph, on a GPU a CUDA graph."""
        fn, _, holders = entries[0]
        theirs = {id(h): mine for _, _, hs in entries for h, mine in zip(hs, holders)}  # an argument that is a holder
        leaves = [theirs.get(id(x), x) for x in flat[0]]

        def body(values, inputs):
            originals = [get_slot(t, key) for t, key in slots]
            for (t, key), value in zip(slots, values):
                set_slot(t, key, value)
            args = list(leaves)  # a copy: a list the call fills would leak what vmap shows as one seed's
            for n, x in zip(where, inputs):
                args[n] = x
            try:
                return fn(*pytree.tree_unflatten(args, flat[1])), [get_slot(t, key) for t, key in slots]
            finally:
                for (t, key), value in zip(slots, originals):
                    set_slot(t, key, value)

        stacked, stand_in = torch.func.vmap(body, randomness="different"), torch.zeros(())
        stacked = compiled(stacked) if self.flags.compile else stacked

        def call(values, inputs):  # a rate given as a float waits outside, a tensor in its place: compiled code would
            floats = [(t, key, get_slot(t, key)) for t, key in slots if not torch.is_tensor(get_slot(t, key))]
            for t, key, _ in floats:  # put the float back as a constant, and compile again when it changes
                set_slot(t, key, stand_in)
            try:
                return stacked(values, inputs)
            except RuntimeError as e:
                if "vmap" not in str(e):
                    raise
                torch_dir = os.path.dirname(torch.__file__)
                tb = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(torch_dir)]
                raise UsageError(f"--num-seeds: {str(e).splitlines()[0][:160]} ({tb[-1].filename}:{tb[-1].lineno}); "
                                 "see docs/modifying.md#many-seeds") from None  # fmt: skip
            finally:
                for t, key, value in floats:
                    set_slot(t, key, value)

        run, call.__name__ = next(r for r in self.runs if r is not None), f"{fn.__name__} of {len(entries)} seeds"
        return CudaGraph(call, run, None, ()) if run.device.type == "cuda" else call

    def write(self, final: bool) -> None:
        """The aggregate folder's summary.json: the seeds' run folders (--resume it), and at the end their aggregate."""
        if os.path.isfile(path := os.path.join(self.dir, "summary.json")) and not final:
            return
        dirs = [run.dir if run is not None else d for run, d in zip(self.runs, self.dirs)]
        summaries = [summary for summary in map(read_summary, dirs if final else []) if summary is not None]
        agg = aggregate(summaries) if summaries else {}
        os.makedirs(self.dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"run_dirs": dirs, "num_seeds": len(dirs), **agg, "args": asdict(self.flags)}, f, indent=2)
        if final and summaries:
            resume = f"; go on with --resume {self.dir}" if any(s["status"] == "interrupted" for s in summaries) else ""
            print(f"{len(dirs)} seeds: {line(agg)}; outputs in {self.dir}{resume}")


def read_summary(folder: Optional[str]) -> Optional[dict]:
    """A run folder's or an aggregate folder's summary.json; None where there is none."""
    if folder is None or not os.path.isfile(path := os.path.join(folder, "summary.json")):
        return None
    with open(path) as f:
        return json.load(f)


def finished(run_dir: str, args) -> bool:
    """Whether `run_dir`'s run has ended as `args` would end it (`Run.start` would refuse it): --resume leaves it."""
    s = read_summary(run_dir) or {"status": None}
    done = s["status"] == "completed" and s["args"]["total_timesteps"] >= args.total_timesteps
    return done or s["status"] == "target return reached" and s["args"]["target_return"] == args.target_return


def stack_slots(optimizer, holders) -> list[tuple]:
    """Where a seed's state lives, as (table, key): its holders' parameters and buffers (modules) or tensor attributes
    (envs), its optimizer's per-parameter state and learning rates."""
    modules = [m for h in holders if isinstance(h, nn.Module) for m in h.modules()]
    tables = [m._parameters for m in modules] + [m._buffers for m in modules]
    tables += [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]] if optimizer else []
    slots = [(t, key) for t in tables for key, v in t.items() if torch.is_tensor(v)]
    objects = [h for h in holders if not isinstance(h, nn.Module)]
    slots += [(h, key) for h in objects for key, v in vars(h).items() if torch.is_tensor(v)]
    return slots + [(group, "lr") for group in (optimizer.param_groups if optimizer else [])]


def get_slot(table, key):
    """A dict's entry or an object's attribute (set as the code sets it: dynamo tracks the two apart)."""
    return table[key] if isinstance(table, dict) else getattr(table, key)


def set_slot(table, key, value) -> None:
    table.__setitem__(key, value) if isinstance(table, dict) else setattr(table, key, value)


def rng_state(state=None):
    """torch's global RNG state (CPU and CUDA), or, given one, set to it."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if state is None:
        return torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def iqm(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    """Interquartile mean: the mean of the middle half, after dropping floor(n/4) scores from each end (as
    scipy.stats.trim_mean(scores, 0.25), which rliable uses)."""
    n = scores.shape[axis]
    return np.sort(scores, axis=axis).take(range(n // 4, n - n // 4), axis=axis).mean(axis=axis)


def stratified_bootstrap_ci(scores: dict[str, np.ndarray], reps: int = 10_000, seed: int = 0, level: float = 0.95):
    """The percentile interval of the IQM over `reps` resamples, each drawing every stratum's (env's) runs with
    replacement from that stratum alone and pooling them (rliable's stratified bootstrap)."""
    rng = np.random.default_rng(seed)
    pooled = [runs[rng.integers(0, len(runs), size=(reps, len(runs)))] for runs in scores.values()]
    samples = iqm(np.concatenate(pooled, axis=1), axis=1)
    return tuple(np.percentile(samples, [100 * (1 - level) / 2, 100 * (1 + level) / 2]))


def aggregate(summaries: list[dict], reps: int = 10_000, seed: int = 0) -> dict:
    """Runs' summary.json files in one (rliable, Agarwal et al. 2021): how many reached the target, the median and
    IQR of the steps to solve, the IQM of the final evaluations with a 95% bootstrap CI; None where none has it."""
    steps = np.array([s["solved_at_step"] for s in summaries if s["solved_at_step"] is not None], dtype=float)
    evals: dict[str, list[float]] = {}
    for s in summaries:
        if s["eval_mean_return"] is not None:
            evals.setdefault(s["env_id"], []).append(s["eval_mean_return"])
    agg = {"runs": len(summaries), "seeds": sorted(s["seed"] for s in summaries), "solved": len(steps),
           "target_reached": sum(s["status"] == "target return reached" for s in summaries),
           "solved_at_step_median": None, "solved_at_step_iqr": None, "evaluated": sum(map(len, evals.values())),
           "eval_iqm": None, "eval_iqm_ci95": None}  # fmt: skip
    if len(steps):
        q1, median, q3 = np.percentile(steps, [25, 50, 75]).tolist()
        agg.update(solved_at_step_median=median, solved_at_step_iqr=[q1, q3])
    if evals:
        ci = stratified_bootstrap_ci({env: np.array(v) for env, v in evals.items()}, reps, seed)
        agg.update(eval_iqm=float(iqm(np.concatenate(list(evals.values())))), eval_iqm_ci95=[float(x) for x in ci])
    return agg


def line(agg: dict) -> str:
    """The aggregate in one line."""
    steps, evals = "none solved", "no evaluation"
    if agg["solved"]:
        (q1, q3), median = agg["solved_at_step_iqr"], agg["solved_at_step_median"]
        steps = f"solved at step median {median:,.0f} (IQR {q1:,.0f}–{q3:,.0f}) of {agg['solved']}"
    if agg["eval_iqm"] is not None:
        low, high = agg["eval_iqm_ci95"]
        evals = f"eval IQM {agg['eval_iqm']:.1f} (95% CI {low:.1f}–{high:.1f}, {agg['evaluated']} runs)"
    return f"{agg['target_reached']}/{agg['runs']} reached the target; {steps}; {evals}"


# Run management: identical in all five scripts
class UsageError(Exception):
    """A bad flag, a wrong combination of flags or a missing package: one `error: ...` line, exit code 2."""


class Run(contextlib.AbstractContextManager):
    """The run folder runs/{env_id}__{exp_name}__{seed}__{time} and all in it (TensorBoard, W&B with --track, videos,
    checkpoints, model, summary.json), the progress bar, --resume, signals, the NaN stop and the final evaluation."""

    def __init__(self, args):
        self.args, self.saved = args, read_checkpoint(args.resume) if args.resume else None
        self.model = read_checkpoint(args.load_model, flag="--load-model") if args.load_model else None
        resumed = args.resume and (args.resume if os.path.isdir(args.resume) else os.path.dirname(args.resume) or ".")
        self.dir = resumed or os.path.join("runs", f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        # the run's progress, checkpointed as is; "seconds" and "timed_steps" leave out set-up and compilation
        self.counters = dict(iteration=0, global_step=0, episodes=0, seconds=0.0, timed_steps=0, solved_step=None,
                             solved_seconds=None, target_reached=False)  # fmt: skip
        self.recent_returns: deque[float] = deque(maxlen=100)
        self.agent = self.progress = self.writer = self.wandb = self.eval_returns = None
        self.handlers, self.stop_signal, self.checkpointed, self.next_check, self.diverged = {}, 0, -1, 0, set()
        self.setup_seconds, self.clock = 0.0, time.perf_counter()  # the one clock: set-up until `start`

    def start(self, agent: nn.Module, envs, optimizer: torch.optim.Optimizer, total_steps: int, obs=None, **stateful):
        """Training begins: the clock starts, the outputs open; --resume restores the checkpoint (`stateful`: your
        state, tensors or objects with a state_dict), --load-model the agent's weights. Returns `obs` or the envs'."""
        self.agent, self.envs, self.optimizer, self.device = agent, envs, optimizer, next(agent.parameters()).device
        a = self.args
        self.stateful = {"agent": agent, "optimizer": optimizer} | {k: v for k, v in stateful.items() if v is not None}
        if odd := [k for k, v in self.stateful.items() if not (torch.is_tensor(v) or hasattr(v, "state_dict"))]:
            raise UsageError(f"run.start({odd[0]}=...) must be a tensor or have a state_dict(), for --resume")
        # the optimizer's settings (torch's load_state_dict takes the checkpoint's), but the rate: the flag's, annealed
        for saved, group in zip(self.saved["optimizer"]["param_groups"] if self.saved else [], optimizer.param_groups):
            for key in [key for key, value in saved.items() if key not in ("params", "lr") and group.get(key) != value]:
                self.note(f"the checkpoint's optimizer {key} {saved[key]} replaces the code's {group.get(key)}")
        try:  # --load-model: a checkpoint's agent or a saved model; --resume: all that `save_checkpoint` wrote
            if self.model is not None:
                agent.load_state_dict(self.model.get("agent", self.model))
            for name, obj in self.stateful.items() if self.saved is not None else ():
                obj.copy_(self.saved[name]) if torch.is_tensor(obj) else obj.load_state_dict(self.saved[name])
        except (RuntimeError, ValueError) as e:  # another network, or a checkpoint of another version of the script
            flag = f"--resume {a.resume}" if self.saved is not None else f"--load-model {a.load_model}"
            raise UsageError(f"{flag} does not fit this agent: {str(e).splitlines()[-1].strip()}") from None
        if self.saved is not None:  # --resume: the rest of the checkpoint, back in place
            self.counters.update(self.saved["counters"])
            done = self.counters["target_reached"] and self.saved["args"]["target_return"] == a.target_return
            if done or self.counters["global_step"] >= total_steps:  # a finished run would only evaluate again
                raise UsageError(f"--resume {a.resume}: the run has ended; raise --total-timesteps or --target-return")
            self.recent_returns.extend(self.saved["recent_returns"])
            self.checkpointed, mine = self.counters["iteration"], self.saved["ranks"][self.rank]
            torch.set_rng_state(mine["rng"])
            if mine["cuda_rng"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda_rng"], self.device)
            obs = obs if mine["envs"] is None else self.envs.load_state_dict(mine["envs"])
            anew = "; the envs have no state_dict(), so their episodes start anew" if mine["envs"] is None else ""
            self.note(f"resumed {self.dir} at step {self.counters['global_step']:,}{anew}")
        for v in self.shared().values() if self.world_size > 1 else ():  # every rank starts from rank 0's weights,
            for tensor in [v] if torch.is_tensor(v) else v.state_dict().values():  # statistics and your state
                dist.broadcast(tensor, src=0)
        if self.rank == 0:
            if a.track:  # a W&B run of its own (--num-seeds: K runs in one process), given the scalars by `log`
                self.wandb = importlib.import_module("wandb").init(project=a.wandb_project_name, entity=a.wandb_entity,
                    config=asdict(a), reinit="create_new", name=os.path.basename(self.dir), resume="allow",
                    id=self.saved and self.saved["wandb_id"], group=a.wandb_group)  # fmt: skip
                self.wandb.define_metric("*", step_metric="global_step")  # TensorBoard's x-axis
            # with --resume, events logged after the checkpoint (by a run killed later) are hidden: no step twice
            self.writer = SummaryWriter(self.dir, purge_step=self.counters["global_step"] + 1 if self.saved else None)
            table = "".join(f"\n|{key}|{value}|" for key, value in asdict(a).items())
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|" + table)
            if a.progress_bar and not a.eval_only and sys.stderr.isatty():  # a log file would fill with its redraws
                end = None if a.target_return is None else f"until return {a.target_return:g}"  # or the ETA's end
                self.progress = tqdm(total=total_steps, initial=self.counters["global_step"], unit_scale=True, desc=end)
        if total_steps < 0.999 * a.total_timesteps and not a.eval_only:  # not for 5M -> 4,999,168
            self.note(f"--total-timesteps {a.total_timesteps:,} is rounded down to whole rollouts: {total_steps:,}")
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            self.handlers = {s: signal.signal(s, self.request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        self.first_iteration, self.saved = self.counters["iteration"] + 1, None  # the restored tensors are in place
        self.setup_seconds, self.clock = time.perf_counter() - self.clock, time.perf_counter()
        return obs

    def request_stop(self, signum: int, frame) -> None:
        """SIGINT/SIGTERM: stop at the end of this iteration, with a checkpoint; a second Ctrl-C stops at once."""
        self.stop_signal = self.stop_signal or signum
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the next Ctrl-C raises KeyboardInterrupt
        self.note(f"{signal.Signals(signum).name}: stopping after this iteration (Ctrl-C again: at once)")

    def shared(self) -> dict:
        """What the torchrun ranks hold alike, by name: the modules (the agent, yours) and tensors given to `start`."""
        return {k: v for k, v in self.stateful.items() if torch.is_tensor(v) or isinstance(v, nn.Module)}

    def greedy(self, play, *args):  # play(agent, *args), an evaluation or a video, in eval mode (dropout off)
        self.agent.eval()
        try:
            return play(self.agent, *args)
        finally:
            self.agent.train()

    def note(self, message: str) -> None:
        """One line to stderr that does not break the progress bar (rank 0's only, under torchrun)."""
        seed = "" if threading.current_thread() is threading.main_thread() else f"{threading.current_thread().name}: "
        tqdm.write(f"note: {seed}{message}", file=sys.stderr) if self.rank == 0 else None

    def log(self, env_steps: int, stats: dict[str, torch.Tensor], rollout) -> bool:
        """One iteration's logs, videos and checkpoint from one host read (shared by the torchrun ranks: they decide
        alike); FloatingPointError on a NaN loss, KeyboardInterrupt(signal) after a signal; True once at the target."""
        c, k = self.counters, 2 + len(stats)
        c["iteration"] += 1
        episodes = torch.stack([x.flatten().float() for x in finished_episodes(rollout)])  # (ended, return, length)
        head = torch.tensor([env_steps, self.stop_signal], dtype=torch.float32, device=self.device)
        mine = torch.cat((head, torch.stack(list(stats.values())).float(), episodes.flatten())).cpu().numpy()
        ranks = [mine]  # the iteration's one host read, above; under torchrun every rank's numbers to every rank
        if self.world_size > 1:
            dist.all_gather_object(ranks := [None] * self.world_size, mine)
        steps, stop_signal = int(sum(r[0] for r in ranks)), int(max(r[1] for r in ranks))
        values = dict(zip(stats, np.mean([r[2:k] for r in ranks], axis=0).tolist()))  # the ranks' mean losses
        ended, returns, lengths = np.concatenate([r[k:].reshape(3, -1) for r in ranks], axis=1)
        returns, lengths = returns[ended > 0], lengths[ended > 0]
        c["global_step"] += steps
        # every loss must be finite (explained variance is NaN for constant returns); another statistic NaN: no value
        if not all(math.isfinite(v) for t, v in values.items() if t.startswith("losses/") and "explained" not in t):
            raise FloatingPointError(f"non-finite loss at iteration {c['iteration']} (env step {c['global_step']})")
        now = time.perf_counter()
        if self.args.compile and c["iteration"] == self.first_iteration:  # LeanRL's burn-in
            self.note(f"--compile: iteration {c['iteration']} took {now - self.clock:.1f} s (compilation), not counted")
            self.setup_seconds += now - self.clock
        else:
            c["seconds"], c["timed_steps"] = c["seconds"] + now - self.clock, c["timed_steps"] + steps
        self.clock = now
        self.recent_returns.extend(returns.tolist())
        c["episodes"] += len(returns)
        mean = float(np.mean(self.recent_returns)) if len(self.recent_returns) == 100 else -math.inf  # a full window
        threshold, target = getattr(self.envs, "reward_threshold", None), self.args.target_return
        if threshold is not None and c["solved_step"] is None and mean >= threshold:
            c["solved_step"], c["solved_seconds"] = c["global_step"], c["seconds"]
        c["target_reached"] = target is not None and mean >= target and self.confirmed(mean, target)
        sps = int(c["timed_steps"] / c["seconds"]) if c["seconds"] else None
        scalars = {"charts/learning_rate": self.optimizer.param_groups[0]["lr"], "charts/SPS": sps} | values
        if len(returns):
            scalars |= {"charts/episodic_return": returns.mean(), "charts/episodic_length": lengths.mean()}
        scalars = {tag: float(value) for tag, value in scalars.items() if value is not None and not math.isnan(value)}
        for tag, value in scalars.items() if self.rank == 0 else ():
            self.writer.add_scalar(tag, value, c["global_step"])
        if self.wandb is not None:  # not W&B's sync_tensorboard: it follows one run per process
            self.wandb.log(scalars | {"global_step": c["global_step"]})
        if self.progress is not None:
            self.progress.update(steps)
            self.progress.set_postfix(SPS=sps, ret=f"{np.mean(self.recent_returns or [np.nan]):.1f}", refresh=False)
        interval = self.args.video_interval if self.args.capture_video and self.rank == 0 else 0
        if interval and (c["iteration"] - 1) % interval == 0:  # iterations 1, 1 + interval, ...
            path = os.path.join(self.dir, "videos", f"training_iter{c['iteration']:05d}.mp4")
            if self.greedy(record_video, self.envs, rollout, self.args, path) and self.wandb is not None:
                self.wandb.log({"videos/training": sys.modules["wandb"].Video(path, format="mp4")})
        if self.args.checkpoint_interval and c["iteration"] % self.args.checkpoint_interval == 0:
            self.save_checkpoint()
        if stop_signal:
            raise KeyboardInterrupt(stop_signal)
        return c["target_reached"]

    def confirmed(self, mean: float, target: float) -> bool:
        """Whether the policy `evaluate` plays reaches the target too (a sampling policy can, while its greedy twin
        drifts off); asked again after 100 more episodes, rank 0 evaluating for all; its time is not training time."""
        if not self.args.eval_episodes or self.counters["episodes"] < self.next_check:
            return not self.args.eval_episodes  # without an evaluation the training episodes decide
        start, self.next_check = time.perf_counter(), self.counters["episodes"] + 100
        self.note(f"the last 100 episodes' mean return {mean:.1f} reached the target: evaluating the policy to confirm")
        self.eval_returns = self.greedy(evaluate, self.envs, self.args, None) if self.rank == 0 else [-math.inf]
        ok = torch.tensor(float(np.mean(self.eval_returns) >= target), device=self.device)
        if self.world_size > 1:  # the ranks stop together
            dist.broadcast(ok, src=0)
        if not ok:
            self.note(f"the evaluation's mean return is {np.mean(self.eval_returns):.1f}: training on")
        self.clock += time.perf_counter() - start
        return bool(ok)

    def save_checkpoint(self) -> None:
        """<run folder>/checkpoint.pt: all `start` restores, written, then renamed (a kill mid-write leaves the old)."""
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        envs = self.envs.state_dict() if hasattr(self.envs, "state_dict") else None  # EnvPool's emulators: none
        ranks = [mine := {"rng": torch.get_rng_state(), "cuda_rng": cuda, "envs": envs}]
        if self.world_size > 1:  # every rank's RNGs and envs, to rank 0
            dist.gather_object(mine, ranks := [None] * self.world_size if self.rank == 0 else None, dst=0)
        self.checkpointed = self.counters["iteration"]
        if self.world_size > 1:  # what trains besides the agent stays alike on every rank only if told to: say so
            sums = {k: float(sum(p.detach().double().sum() for p in ([v] if torch.is_tensor(v) else v.parameters())))
                    for k, v in self.shared().items()}  # fmt: skip
            dist.all_gather_object(every := [None] * self.world_size, sums)
            for k in [k for k in sums if len({rank[k] for rank in every}) > 1 and k not in self.diverged]:
                self.diverged.add(k)
                fix = f"average_gradients({k}) between backward() and step(), docs/modifying.md"
                self.note(f"{k} differs between the torchrun ranks (average its gradients: {fix}); rank 0's is saved")
        if self.rank == 0:
            checkpoint = {k: v if torch.is_tensor(v) else v.state_dict() for k, v in self.stateful.items()} | {
                "ranks": ranks, "script": os.path.basename(__file__), "args": asdict(self.args),
                "counters": self.counters, "recent_returns": list(self.recent_returns),
                "wandb_id": self.wandb and self.wandb.id}  # fmt: skip
            path = os.path.join(self.dir, "checkpoint.pt")
            with open(path + ".tmp", "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename, so a crash cannot leave a renamed empty file
            os.replace(path + ".tmp", path)  # atomic

    def __exit__(self, exc_type, exc, tb) -> None:  # None: an exception goes on to main
        try:  # the handlers stay while the outputs are written: a signal now ends only the final evaluation
            self.finish(exc_type, exc)
        finally:
            for sig, handler in self.handlers.items():
                signal.signal(sig, handler)

    def finish(self, exc_type, exc) -> None:  # the final checkpoint; then rank 0's model, evaluation and summary
        if self.progress is not None:
            self.progress.total = self.progress.n  # the bar ends where training ended
            self.progress.close()
        a, c, stopped = self.args, self.counters, isinstance(exc, KeyboardInterrupt) and bool(exc.args)
        status = "evaluated" if a.eval_only else "target return reached" if c["target_reached"] else "completed"
        if exc is not None:
            status = {KeyboardInterrupt: "interrupted", FloatingPointError: "non-finite loss"}.get(exc_type, "error")
        whole = (exc is None or stopped) and self.agent is not None  # at the end of an iteration: not a second Ctrl-C
        if whole and not a.eval_only and self.checkpointed != c["iteration"]:  # the state is whole: a checkpoint
            self.save_checkpoint()
        if whole and self.world_size > 1:  # the last collective: rank 0 alone goes on, however long it evaluates
            dist.barrier()
        if self.writer is None:  # not rank 0, or not started (a flag refused late, a failed resume leave no trace)
            return
        s = dict(env_id=a.env_id, exp_name=a.exp_name, seed=a.seed, device=a.device, world_size=self.world_size,
                 status=status, total_env_steps=c["global_step"], iterations=c["iteration"],
                 wall_seconds=round(c["seconds"], 3), setup_seconds=round(self.setup_seconds, 3),
                 mean_sps=round(c["timed_steps"] / c["seconds"], 1) if c["seconds"] else None, episodes=c["episodes"],
                 mean_return_last_100=float(np.mean(self.recent_returns)) if self.recent_returns else None,
                 solved_threshold=getattr(self.envs, "reward_threshold", None), solved_at_step=c["solved_step"],
                 solved_at_seconds=c["solved_seconds"] and round(c["solved_seconds"], 3), eval_returns=None,
                 eval_mean_return=None, model_path=None)  # fmt: skip
        if status != "non-finite loss" and a.save_model:  # NaN weights are not worth keeping
            s["model_path"] = os.path.join(self.dir, f"{a.exp_name}.cleanrl_model")
            torch.save(self.agent.state_dict(), s["model_path"])
        if a.eval_episodes and status in ("completed", "target return reached", "evaluated") and not self.stop_signal:
            video = os.path.join(self.dir, "videos", "evaluation.mp4") if a.capture_video else None
            for sig in self.handlers:  # a signal now ends the evaluation at once; summary.json is still written
                signal.signal(sig, signal.default_int_handler)
            with contextlib.suppress(KeyboardInterrupt):  # the evaluation that confirmed the target, unless filmed
                if not (reuse := c["target_reached"] and video is None):
                    self.note(f"evaluating the policy on {a.eval_episodes} episodes")
                s["eval_returns"] = self.eval_returns if reuse else self.greedy(evaluate, self.envs, a, video)
                s["eval_mean_return"] = float(np.mean(s["eval_returns"]))
                self.writer.add_scalar("eval/episodic_return", s["eval_mean_return"], c["global_step"])
                if self.wandb is not None:  # at the last global_step (define_metric's step_sync)
                    self.wandb.log({"eval/episodic_return": s["eval_mean_return"]})
                    if video and os.path.exists(video):
                        self.wandb.log({"videos/evaluation": sys.modules["wandb"].Video(video, format="mp4")})
        with open(os.path.join(self.dir, "summary.json"), "w") as f:
            json.dump(s | {"args": asdict(a)}, f, indent=2)
        self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        shown = "total_env_steps wall_seconds mean_sps mean_return_last_100 solved_at_step eval_mean_return".split()
        number = lambda value: f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"
        line = ", ".join(f"{key} {number(s[key])}" for key in shown if s[key] is not None)
        resume = f"; go on with --resume {self.dir}" if status == "interrupted" and self.checkpointed >= 0 else ""
        print(f"{status}: {line}; outputs in {self.dir}{resume}")  # last, after W&B's own summary


def check_run_flags(args) -> torch.device:
    """Reject bad run-management flags in one line (UsageError) before anything is built; return the device."""
    names = ("eval_episodes", "torch_threads", "video_interval", "checkpoint_interval")
    gpus = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # found; needed: one per process
    check_flags(args, {name: (getattr(args, name) >= 0, ">= 0") for name in names} | {
        "device": (args.device == "cpu" or args.device.split(":")[0] == "cuda" and gpus[0] >= gpus[1],
                   f"cpu, or cuda with a CUDA GPU per process ({gpus[0]} found, {gpus[1]} needed)")})  # fmt: skip
    compiler = os.environ.get("CXX", {"win32": "cl", "darwin": "clang++"}.get(sys.platform, "g++"))  # inductor's
    if args.compile and args.device == "cpu" and not shutil.which(compiler):
        raise UsageError("--compile on the CPU needs a C++ compiler: install g++ (or set CXX), or leave out --compile")
    for flag, module, pin in (("capture_video", "imageio", "imageio==2.38.1"), ("track", "wandb", "wandb==0.31.0")):
        if getattr(args, flag) and importlib.util.find_spec(module) is None:
            raise UsageError(f"--{flag.replace('_', '-')} needs {module}: pip install {pin}")
    if args.eval_only != bool(args.load_model) or (args.resume and args.eval_only):
        raise UsageError("--eval-only and --load-model PATH go together (to train on from a checkpoint: --resume)")
    if args.resume:  # one rule: the algorithm's flags, those before --total-timesteps in Args, are the checkpoint's
        saved, names = read_checkpoint(args.resume), list(Args.__dataclass_fields__)
        check_flags(args, {n: (getattr(args, n) == saved["args"].get(n), f"the checkpoint's {saved['args'].get(n)} "
                               "(--resume may change the flags from --total-timesteps on)")
                           for n in names[: names.index("total_timesteps")]})  # fmt: skip
        if len(saved["ranks"]) != int(os.environ.get("WORLD_SIZE", "1")):
            raise UsageError(f"--resume: the checkpoint is of {len(saved['ranks'])} torchrun ranks; resume on as many")
    return torch.device(args.device)


def read_checkpoint(path: str, flag: str = "--resume") -> dict:
    """The checkpoint at `path` (or `path`/checkpoint.pt; with --load-model a model too) as plain data, on the CPU."""
    file, script = os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path, os.path.basename(__file__)
    if not os.path.isfile(file) and os.path.isfile(group := os.path.join(path, "summary.json")):  # K seeds' folder:
        with open(group) as f:  # the first seed's checkpoint, for K seeds
            dirs = json.load(f).get("run_dirs") or [file]  # a run's own: no checkpoint
        saved = read_checkpoint(dirs[0], flag)
        return saved | {"args": saved["args"] | {"num_seeds": len(dirs)}}
    if not os.path.isfile(file):
        raise UsageError(f"{flag} {path}: no such file")
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, or holding objects other than plain data
        raise UsageError(f"{flag} {file} is not a readable checkpoint ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(saved, dict) or saved.get("script", script) != script:
        raise UsageError(f"{flag} {file} was written by {saved.get('script', 'something else')}, not {script}")
    if flag == "--resume" and "counters" not in saved:
        raise UsageError(f"--resume {file} holds weights only; evaluate them with --eval-only --load-model")
    return saved


def parse_args() -> Args:
    """tyro's command line, its error box made one `error: ...` line; with --resume, flags left out keep their value."""
    argv, default = sys.argv[1:], tyro.MISSING_NONPROP
    resume = [v for f, v in zip(argv, argv[1:]) if f == "--resume"] + [f[9:] for f in argv if f.startswith("--resume=")]
    if resume and resume[-1] != "None":
        default = Args(**{k: v for k, v in read_checkpoint(resume[-1])["args"].items() if k in Args.__annotations__})
    try:
        with contextlib.redirect_stderr(box := io.StringIO()):
            return tyro.cli(Args, default=default)
    except SystemExit as e:
        if e.code != 2:  # --help
            raise
        rows = [row.strip("│|╭╮╰╯ ") for row in box.getvalue().splitlines()]  # a unicode or an ASCII box
        rules = [i for i, row in enumerate(rows) if not row.strip("─-+= ") or row.startswith("─")] + [len(rows)]
        message = " ".join(row for row in rows[rules[0] + 1 : next(i for i in rules if i > rules[0] + 1)] if row)
        hint = rows[rows.index("Perhaps you meant:") + 1].split()[0] if "Perhaps you meant:" in rows else None
        raise UsageError(message + (f"; did you mean {hint}?" if hint else "")) from None


def main() -> None:
    try:
        args = parse_args()
        device = check_run_flags(args)
        if "LOCAL_RANK" in os.environ:  # torchrun: join the group (a collective waiting 5 minutes fails, not hangs)
            if device.type == "cuda":  # this rank's GPU
                torch.cuda.set_device(device := torch.device("cuda", int(os.environ["LOCAL_RANK"])))
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=5))
        if device.type == "cpu":  # process-wide, so set here rather than inside train(); the ranks share the cores
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            per_rank = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            torch.set_num_threads(args.torch_threads or (per_rank if args.num_envs >= THREADED_FROM_ENVS else 1))
        train_seeds(train, replace(args, device=str(device)))  # its end syncs the ranks, then rank 0 writes alone
    except UsageError as e:
        rank = int(os.environ.get("RANK", "0"))  # under torchrun every rank finds the same error: rank 0 says it
        time.sleep(10 if rank else 0)  # once, and torchrun stops the others when it exits (one still here has its own)
        print(f"error: {e}" if rank == 0 else f"error: rank {rank}: {e}", file=sys.stderr)
        sys.exit(2)
    except FloatingPointError as e:
        sys.exit(f"error: {e}; lower --learning-rate or --max-grad-norm")
    except FrozenInstanceError as e:  # e.g. `args.ent_coef = ...` in train(): a value that changes must be a tensor
        sys.exit(f"error: {e}: the flags are fixed for the run; see docs/modifying.md#values-that-change-in-training")
    except KeyboardInterrupt as e:  # a signal, stopped after an iteration (carrying its number), or a second Ctrl-C
        signum, checkpoint = (e.args[0], ", with a checkpoint") if e.args else (signal.SIGINT, "")
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"interrupted by {signal.Signals(signum).name}{checkpoint}", file=sys.stderr)
        sys.exit(128 + signum)  # 130 for SIGINT, 143 for SIGTERM
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
