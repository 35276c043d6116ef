"""PPO on Atari through EnvPool 1.x (C++ emulators), with the Nature CNN.

CleanRL's ppo_atari_envpool.py for today's stack (envpool 1.x with gymnasium's API, numpy 2, torch, tyro): the
emulators run in EnvPool's C++ thread pool, the policy and the update on `--device` (cuda when there, else the CPU).

Run:
    python ppo_atari_envpool.py                              # Breakout-v5, CleanRL's Atari defaults
    python ppo_atari_envpool.py --env-id Pong-v5 --async-envs
    tensorboard --logdir runs

The env is EnvPool's Atari preprocessing (Mnih et al. 2015; the list: docs/ppo_atari_envpool.md), training on lives
(`episodic_life`) and clipped rewards (`reward_clip`); the scores logged are the real game scores (see `GameStats`).
EnvPool resets an env on the step *after* it reported done (the new game's first frame, reward 0, the action ignored):
that step is stored but masked out of the loss, and GAE cuts its recursion at every done. The observation returned
with done is the real last frame, so a game cut by the step limit is bootstrapped from its value.

The update (Schulman et al. 2017; "detail N": Huang et al. 2022, "The 37 Implementation Details of PPO"):
    r_t(θ)  = π_θ(a_t|s_t) / π_θold(a_t|s_t)
    δ_t     = r_t + γ (1 - term_t) V(s_{t+1}) - V(s_t)
    Â_t     = δ_t + γλ (1 - done_t) Â_{t+1}
    L_clip  = E[ max(-Â_t r_t(θ), -Â_t clip(r_t(θ), 1-ε, 1+ε)) ]
    L_V     = ½ E[ max((V_θ(s_t) - R_t)², (V_old + clip(V_θ - V_old, -ε, ε) - R_t)²) ],  R_t = Â_t + V_old(s_t)
    L       = L_clip - c_ent H[π_θ] + c_vf L_V
π_θold and V_old are the policy and critic of the update's start on every row, also on the rows an env
acted on before the previous update (see `carry_over`), so the ratio starts at 1.
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
from collections import deque
from dataclasses import FrozenInstanceError, asdict, dataclass, replace
from datetime import timedelta
from typing import NamedTuple, Optional

# OpenMP threads that sleep, not spin, while they wait (4x faster on a busy 2-core machine): set before torch loads it
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before a process group exists: docs/running.md, "torchrun"
import torch.nn as nn
import tyro
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

THREADED_FROM_ENVS = 0  # one torch thread per core at any env count: the CNN's convolutions are large


@dataclass(frozen=True)  # the run's flags, fixed: what changes in training is a tensor (docs/modifying.md)
class Args:
    # Algorithm: a --resume keeps these as the checkpoint has them
    env_id: str = "Breakout-v5"
    """the EnvPool Atari game id, e.g. Breakout-v5, Pong-v5, SpaceInvaders-v5"""
    seed: int = 1
    """seed of the networks, the action sampling and the environments"""
    learning_rate: float = 2.5e-4
    """Adam learning rate"""
    num_envs: int = 8
    """parallel game instances (per process under torchrun)"""
    num_steps: int = 128
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
    clip_coef: float = 0.1
    """surrogate clipping coefficient epsilon (detail 8)"""
    clip_vloss: bool = True
    """clip the value loss around the old values (detail 9)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient (detail 10)"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """global gradient-norm clipping (detail 11)"""
    target_kl: Optional[float] = None
    """stop the epochs of an update early once the approximate KL exceeds this (None: never)"""
    async_envs: bool = False
    """step the envs asynchronously: EnvPool hands back the first half of the envs ready, the rest still emulating"""
    channels_last: bool = True
    """keep conv activations in channels-last memory layout (faster convolutions: docs/ppo_atari_envpool.md)"""
    bf16: bool = False
    """the CNN trunk in bfloat16 autocast (heads and weights float32); needs AMX/AVX512-BF16 CPUs or Ampere+ GPUs"""

    # The run's length and its management: a --resume may change these
    total_timesteps: int = 10_000_000
    """agent steps (4 frames each), all torchrun ranks together; CleanRL's 10M: 5-11 h on a 2-core CPU (250-540 SPS)"""
    target_return: Optional[float] = None
    """stop once the mean score of the last 100 games reaches this (None: run all steps)"""
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """torch device for the networks and the update (cuda when available, else cpu)"""
    torch_threads: int = 0
    """CPU threads for torch; 0 picks one per available core (ignored on GPU)"""
    compile: bool = False
    """torch.compile the network (pays a one-off compile time)"""
    num_seeds: int = 1
    """1 here: EnvPool's emulators run one seed per process (the four tensor scripts stack K seeds in one)"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "rl-ladder"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team); None uses your default"""
    wandb_group: Optional[str] = None
    """the W&B group of the run (--num-seeds: each seed's run in the group of their aggregate folder's name)"""
    capture_video: bool = False
    """save a grid video of up to 16 envs' frames from the rollout every `video-interval` iterations"""
    video_interval: int = 100
    """iterations between two videos, the first at iteration 1 (0: no videos during training)"""
    save_model: bool = False
    """save the agent's weights to the run folder at the end (also on Ctrl-C)"""
    checkpoint_interval: int = 100
    """iterations between checkpoints to <run folder>/checkpoint.pt (0: only at the end, on Ctrl-C or SIGTERM)"""
    resume: Optional[str] = None
    """a run folder (or its checkpoint.pt) to go on from: omitted flags keep its values; only these run flags change"""
    eval_only: bool = False
    """no training: play `eval-episodes` episodes with the `load-model` weights (filmed with --capture-video)"""
    load_model: Optional[str] = None
    """the weights for --eval-only: a saved .cleanrl_model or a checkpoint.pt"""
    eval_episodes: int = 4
    """whole games played by the final policy after training, scored with the real rewards (0 skips)"""
    progress_bar: bool = True
    """show a live progress bar with SPS, the recent game score and the time left"""

    def __post_init__(self):
        """The algorithm's flags checked, for the command line and `Args(...)` in code alike (the run's: `main`)."""
        batch_size = self.num_envs * self.num_steps
        check_flags(self, {
            "env_id": (is_atari_game(self.env_id), "an EnvPool Atari game (envpool.list_all_envs(): e.g. Pong-v5)"),
            "num_envs": (self.num_envs >= 1 + self.async_envs, "positive (--async-envs: at least 2)"),
            "num_steps": (self.num_steps > 0, "positive"),
            "update_epochs": (self.update_epochs > 0, "positive"),
            "num_minibatches": (0 < self.num_minibatches <= batch_size,
                                f"in [1, --num-envs * --num-steps = {batch_size}]"),
            "total_timesteps": (self.total_timesteps >= batch_size, f"at least one rollout ({batch_size} steps)"),
            "learning_rate": (self.learning_rate > 0, "> 0"),
            "gamma": (0 < self.gamma <= 1, "in (0, 1]"),
            "gae_lambda": (0 <= self.gae_lambda <= 1, "in [0, 1]"),
            "clip_coef": (self.clip_coef > 0, "> 0"),
            "ent_coef": (self.ent_coef >= 0, ">= 0"),
            "vf_coef": (self.vf_coef >= 0, ">= 0"),
            "max_grad_norm": (self.max_grad_norm > 0, "> 0"),
            "target_kl": (self.target_kl is None or self.target_kl > 0, "> 0"),
            "num_seeds": (self.num_seeds == 1, "1: EnvPool runs one seed per process (K processes: a --seed each)"),
            "bf16": (not self.bf16 or has_fast_bf16(self.device), "off here: no bfloat16 hardware (AMX or AVX512-BF16 "
                     "CPUs, GPUs from Ampere on) to run it faster than float32"),
        })  # fmt: skip


# Environment ----------------------------------------------------------------------------------
def make_env(env_id: str, num_envs: int, seed: int, batch_size: Optional[int] = None):
    """An EnvPool Atari pool (gymnasium API) with the training settings: episodes end on a lost life
    and rewards are clipped (`info["reward"]` keeps the raw ones). `recv` hands back `batch_size` envs."""
    import envpool

    return envpool.make(
        env_id, env_type="gymnasium", num_envs=num_envs, batch_size=batch_size or num_envs, seed=seed,
        episodic_life=True, reward_clip=True,
    )  # fmt: skip


# Agent ----------------------------------------------------------------------------------------
def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    """Orthogonal weights, constant bias (detail 2)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature CNN (Mnih et al. 2015) as a shared trunk, with actor and critic heads, on uint8 frames (B, 4, 84, 84)
    scaled by 1/255 inside (the rollout stays uint8); `bf16`: the trunk in bfloat16 autocast, the heads in float32."""

    def __init__(self, num_actions: int, bf16: bool = False, channels_last: bool = False):
        super().__init__()
        self.bf16 = bf16
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
        )  # fmt: skip
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1.0)
        self.to(memory_format=self.memory_format)

    def forward(self, obs: torch.Tensor):
        """Logits and value of uint8 observations."""
        obs = obs.contiguous(memory_format=self.memory_format)
        with torch.autocast(obs.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            hidden = self.network(obs.float() / 255.0)
        hidden = hidden.float()
        return self.actor(hidden), self.critic(hidden).squeeze(-1)

    def get_action(self, obs: torch.Tensor, greedy: bool = False):
        """An action (sampled, or the most likely with `greedy`), its log-probability and the value."""
        logits, value = self(obs)
        gumbel = 0.0 if greedy else -torch.empty_like(logits).exponential_().log()  # Gumbel noise, -log(Exp(1))
        action = (logits + gumbel).argmax(-1)  # Gumbel-max: the argmax samples the softmax distribution
        logprob = logits.log_softmax(-1).gather(-1, action.unsqueeze(-1)).squeeze(-1)
        return action, logprob, value

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor):
        """Log-probability of `action`, entropy, and value."""
        logits, value = self(obs)
        logp = logits.log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, action.unsqueeze(-1)).squeeze(-1), entropy, value


# Algorithm ------------------------------------------------------------------------------------
class Rollout(NamedTuple):
    """Every env's steps in its own column, in that env's order, and the pool's bookkeeping. Rows 0..T-1 of a column are
    the rollout's T steps, row T the observation to bootstrap from (the next rollout's row 0); async envs come back in
    any order, and one may run past row T while the others catch up: hence 2T+1 rows. Tensors on the device."""

    obs: torch.Tensor  # (2T+1, N, 4, 84, 84) uint8, the observation each action was chosen on
    actions: torch.Tensor  # (2T+1, N)
    logprobs: torch.Tensor  # (2T+1, N) log π_old(a|s)
    values: torch.Tensor  # (2T+1, N) V_old(s)
    rewards: torch.Tensor  # (2T+1, N) the (clipped) reward of this row's action
    terminated: torch.Tensor  # (2T+1, N) a life was lost at this step: no future to bootstrap
    dones: torch.Tensor  # (2T+1, N) terminated or truncated: an episode ended at this step
    valid: torch.Tensor  # (2T+1, N) False for the reset step that follows a done (its action is ignored)
    filled: np.ndarray  # (N,) rows filled per env
    parked: np.ndarray  # (N,) envs whose last action waits for the next rollout
    game_stats: GameStats  # the scores of the games in progress
    games: list[tuple[float, int]]  # (score, length) of the games that ended during the last rollout

    @staticmethod
    def empty(num_steps: int, num_envs: int, device: torch.device) -> Rollout:
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(2 * num_steps + 1, num_envs, *shape, dtype=dtype,
                                                                device=device)  # fmt: skip
        flags = (zeros(dtype=torch.bool) for _ in range(3))  # terminated, dones, valid
        tensors = (zeros(4, 84, 84, dtype=torch.uint8), zeros(dtype=torch.long), zeros(), zeros(), zeros(), *flags)
        return Rollout(*tensors, np.zeros(num_envs, dtype=np.int64), np.zeros(num_envs, bool), GameStats(num_envs), [])


class Batch(NamedTuple):
    """The valid steps of a rollout, flattened, with what the loss needs."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor  # log π_old(a|s)
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor  # V_old(s)


@torch.inference_mode()
def collect_rollout(agent: Agent, envs, rollout: Rollout, env_batch: int) -> int:
    """Fill every env's column of `rollout` up to row T with the current policy; return the steps emulated.

    EnvPool hands back `env_batch` envs per `recv` (all of them in sync mode), in any order. A step's reward and flags
    arrive with the next observation, so they go to the env's previous row. An env that has its T+1 rows is parked (its
    last action waits for the next rollout) as long as `env_batch` envs stay in flight for EnvPool to fill a batch; the
    rows an env still runs past T are kept for the next rollout."""
    T = len(rollout.obs) // 2
    filled, parked, device = rollout.filled, rollout.parked, rollout.obs.device
    if filled.min() > T:  # the last rollout's rows past T become this one's first rows
        carry_over(agent, rollout)
    rollout.games.clear()
    if parked.any():
        ids = np.flatnonzero(parked)
        envs.send(rollout.actions[filled[ids] - 1, ids].cpu().numpy(), ids.astype(np.int32))
        parked[:] = False
    env_steps = 0
    while filled.min() < T + 1:
        obs, reward, terminated, truncated, info = envs.recv()
        ids, done = info["env_id"], terminated | truncated
        row = filled[ids]
        if row.max() >= len(rollout.obs):
            raise RuntimeError("an async env ran more than a rollout ahead of the others")
        # this step's reward and flags belong to each env's previous row (absent right after the first reset)
        prev = row > 0
        prev_rows, prev_ids = torch.from_numpy(row[prev] - 1), torch.from_numpy(ids[prev])
        rollout.rewards[prev_rows, prev_ids] = torch.from_numpy(reward[prev]).to(device)
        rollout.terminated[prev_rows, prev_ids] = torch.from_numpy(terminated[prev]).to(device)
        rollout.dones[prev_rows, prev_ids] = torch.from_numpy(done[prev]).to(device)
        rollout.games.extend(
            rollout.game_stats.update(ids, info["reward"], game_over(info, truncated), info["elapsed_step"])
        )

        obs_t = torch.from_numpy(obs).to(device)
        action, logprob, value = agent.get_action(obs_t)
        # park envs that have their T+1 rows, keeping at least a batch of envs in flight
        done_rows = row + 1 >= T + 1
        room = len(filled) - env_batch - int(parked.sum())
        park = done_rows & (np.cumsum(done_rows) <= room)
        parked[ids[park]] = True
        if not park.all():
            envs.send(action.cpu().numpy()[~park], ids[~park])
        row_t, ids_t = torch.from_numpy(row), torch.from_numpy(ids)
        rollout.obs[row_t, ids_t] = obs_t
        rollout.actions[row_t, ids_t] = action
        rollout.logprobs[row_t, ids_t] = logprob
        rollout.values[row_t, ids_t] = value
        # an env that has just reported done spends its next step resetting, whatever the action
        rollout.valid[row_t, ids_t] = torch.from_numpy(~done).to(device)
        filled[ids] += 1
        env_steps += int(prev.sum())  # steps emulated; the first recv after the reset is none
    return env_steps


def carry_over(agent: Agent, rollout: Rollout) -> None:
    """Move each env's rows past T (row T, and the rows an async env ran ahead) to the top of its column,
    with the log-probability and value of the current policy: their actions were chosen before the last
    update (the action stays: the env has it), and the next update's ratio must start at 1 on them too."""
    T = len(rollout.obs) // 2
    for buf in rollout[:8]:  # the (2T+1, N) tensors
        buf[: T + 1] = buf[T:].clone()
    rollout.filled[:] -= T
    rows, ids = torch.from_numpy(np.arange(T + 1)[:, None] < rollout.filled).nonzero(as_tuple=True)
    logprobs, _, values = agent.evaluate(rollout.obs[rows, ids], rollout.actions[rows, ids])
    rollout.logprobs[rows, ids], rollout.values[rows, ids] = logprobs, values


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


def ppo_loss(agent: Agent, args: Args, batch: Batch):
    """Clipped-surrogate PPO loss on a minibatch; returns (loss, statistics keyed by TensorBoard tag)."""
    newlogprob, entropy, newvalue = agent.evaluate(batch.obs, batch.actions)
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
    """1 - Var[R - V] / Var[R], the share of the returns' variance the critic explains; NaN when the
    returns are constant (as in CleanRL), where the ratio means nothing."""
    var_returns = returns.var()
    return torch.where(var_returns == 0, torch.nan, 1 - (returns - values).var() / var_returns)


def update(step, batch: Batch, args: Args) -> dict[str, torch.Tensor]:
    """`update-epochs` passes over the batch in shuffled minibatches (detail 6), a gradient `step(batch, idx)` on each,
    ending early once the approximate KL exceeds `target-kl`. Returns the mean of each loss statistic and the
    critic's explained variance."""
    history = []
    for _ in range(args.update_epochs):
        for idx in torch.randperm(len(batch.actions), device=batch.actions.device).tensor_split(args.num_minibatches):
            history.append(step(batch, idx))
        # a host read per epoch; under torchrun the ranks judge their mean KL, so they stop together
        if args.target_kl is not None and mean_over_ranks([history[-1]["losses/approx_kl"]])[0] > args.target_kl:
            break
    means = {tag: torch.stack([stats[tag] for stats in history]).mean() for tag in history[0]}
    return means | {"losses/explained_variance": explained_variance(batch.values, batch.returns)}


def train(args: Args) -> Agent:
    """Train PPO on the `--env-id` game and return the agent. `Run` writes the outputs, also when an exception ends
    the run."""
    device, T, N = torch.device(args.device), args.num_steps, args.num_envs
    env_batch = N // 2 if args.async_envs else N  # async: EnvPool emulates half the envs while the policy acts
    with Run(args) as run:
        # --total-timesteps counts all ranks' steps; --eval-only trains not at all (Run evaluates at the end)
        num_iterations = 0 if args.eval_only else args.total_timesteps // (T * N * run.world_size)
        envs = make_env(args.env_id, N, args.seed + run.rank * N, batch_size=env_batch)  # env i gets seed + i
        torch.manual_seed(args.seed + run.rank)  # under torchrun each rank samples its own actions
        agent = Agent(envs.single_action_space.n, args.bf16, args.channels_last).to(device)  # rank 0's, see run.start
        if args.compile:  # compile the forward pass only, so the weights keep their plain names
            agent.forward = torch.compile(agent.forward)
        optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)  # eps: detail 3
        initial_lrs = [group["lr"] for group in optimizer.param_groups]  # each group anneals from its own
        step = functools.partial(gradient_step, agent, optimizer, ppo_loss, args)
        rollout = Rollout.empty(T, N, device)
        envs.async_reset()
        # with --resume: agent, optimizer, RNGs and counters as the checkpoint left them (EnvPool's games start anew;
        # your own state goes in by name: a tensor changed in place, or an object with a state_dict())
        run.start(agent, envs, optimizer, num_iterations * T * N * run.world_size)
        for iteration in range(run.counters["iteration"] + 1, num_iterations + 1):
            for group, lr in zip(optimizer.param_groups, initial_lrs) if args.anneal_lr else ():
                group["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * lr
            env_steps = collect_rollout(agent, envs, rollout, env_batch)
            # rows 0..T-1 are complete steps; row T holds each env's next observation and its value
            advantages, returns = compute_gae(rollout.rewards[:T], rollout.values[:T], rollout.values[1 : T + 1],
                                              rollout.terminated[:T], rollout.dones[:T],
                                              args.gamma, args.gae_lambda)  # fmt: skip
            valid = rollout.valid[:T].flatten()  # the reset steps are left out of the loss
            b_obs, b_actions, b_logprobs, b_values = (x[:T].flatten(0, 1)[valid] for x in rollout[:4])
            batch = Batch(b_obs, b_actions, b_logprobs, advantages.flatten()[valid], returns.flatten()[valid], b_values)
            stats = update(step, batch, args)
            if run.log(env_steps, stats, rollout):  # True once the target return is reached
                break
    return agent


# What train() and the run management call: game ids, game scores, evaluation, videos
def is_atari_game(env_id: str) -> bool:
    """Whether EnvPool has this Atari game (UsageError when envpool is not installed)."""
    try:
        import envpool
    except ImportError:
        raise UsageError("this script needs envpool: pip install envpool==1.2.5") from None
    return env_id in envpool.list_all_envs() and type(envpool.make_spec(env_id)).__name__ == "AtariEnvSpec"


class GameStats:
    """Real game scores: the unclipped rewards summed over all lives of a game.

    With `episodic_life` the agent's episodes end at every lost life, and with `reward_clip` its
    rewards are signs; neither is the game's score. EnvPool reports the raw reward in
    `info["reward"]` and the real end of a game in `info["terminated"]` (1 only when the last life
    is lost; `lives` is no use, Pong has none) or `truncated` (the step limit).
    """

    def __init__(self, num_envs: int):
        self.scores = np.zeros(num_envs, dtype=np.float64)

    def update(self, env_ids, raw_rewards, game_over, elapsed_steps) -> list[tuple[float, int]]:
        """Add one step's raw rewards for `env_ids`; return (score, length) of each game that ended."""
        self.scores[env_ids] += raw_rewards
        ended = np.asarray(env_ids)[np.asarray(game_over, dtype=bool)]
        lengths = np.asarray(elapsed_steps)[np.asarray(game_over, dtype=bool)]
        games = [(float(self.scores[e]), int(n)) for e, n in zip(ended, lengths)]
        self.scores[ended] = 0.0
        return games


def game_over(info: dict, truncated: np.ndarray) -> np.ndarray:
    """Which envs' games ended at this step: the last life lost, or the step limit."""
    return (info["terminated"] == 1) | truncated


def finished_episodes(rollout: Rollout):
    """(ended, return, length), tensors of one shape: the games that ended during `rollout`, with their real scores
    (unclipped rewards over all lives, see `GameStats`)."""
    games = torch.tensor(rollout.games, dtype=torch.float32, device=rollout.obs.device).view(-1, 2)
    return torch.ones(len(games), dtype=torch.bool, device=rollout.obs.device), games[:, 0], games[:, 1]


def evaluate(agent: Agent, envs, args: Args, video: Optional[str]) -> list[float]:
    """Real score of one whole game in each of `eval-episodes` fresh envs under the sampling policy, drawing from its
    own seeded random stream (so --eval-only on the saved model plays the same games); with a `video` path, a grid
    video there of (up to 16 of) the games at their real speed, 15 agent steps (60 frames) a second, each held on its
    last frame once over.

    The envs lose lives as in training: after each lost life EnvPool's reset presses FIRE, which the agent never
    learned to do (without it Breakout waits for FIRE until the 27000-step limit). A game is over when its last life
    is lost or at the step limit; its score is the raw rewards' sum.
    """
    n, device = args.eval_episodes, next(agent.parameters()).device
    envs, game_stats, scores, last = make_env(args.env_id, n, args.seed + 1), GameStats(n), np.full(n, np.nan), None
    obs, info = envs.reset()
    ids = info["env_id"]
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        video_writer(video, fps=15) if video else contextlib.nullcontext() as writer,
    ):
        torch.manual_seed(args.seed + 1)
        while np.isnan(scores).any():
            if writer is not None:  # the envs in id order, the finished ones held still
                frames = torch.from_numpy(obs[np.argsort(ids)][:16])
                if last is not None:
                    frames = torch.where(torch.from_numpy(np.isnan(scores[:16])).view(-1, 1, 1, 1), frames, last)
                writer.append_data(grid_video((last := frames)[None])[0])
            with torch.inference_mode():
                action, _, _ = agent.get_action(torch.from_numpy(obs).to(device))
            obs, _, _, truncated, info = envs.step(action.cpu().numpy(), ids)
            ids, over = info["env_id"], game_over(info, truncated)
            games = game_stats.update(ids, info["reward"], over, info["elapsed_step"])
            for env, (score, _) in zip(ids[over], games):
                if np.isnan(scores[env]):  # each env's first game: later ones would favour short games
                    scores[env] = score
    envs.close()
    return scores.tolist()


def record_video(agent: Agent, envs, rollout: Rollout, args: Args, path: str) -> str:
    """A grid video of up to 16 envs' frames from `rollout`'s T steps at `path`; returns the path."""
    with video_writer(path, fps=15) as writer:
        for frame in grid_video(rollout.obs[: len(rollout.obs) // 2]):
            writer.append_data(frame)
    return path


def grid_video(frames: torch.Tensor) -> np.ndarray:
    """RGB frames (T, rows*84, cols*84, 3) uint8 of a rollout of stacked observations (T, N, 4, 84, 84): up to 16
    envs tiled as squarely as they fit without a wasted row (8 envs: 2x4, 9: 3x3, 16: 4x4)."""
    frames = frames[:, :16, -1]  # the newest frame of each stack
    t, n, h, w = frames.shape
    rows = math.isqrt(n)
    cols = -(-n // rows)
    if n < rows * cols:  # black tiles fill the last row
        frames = torch.cat((frames, frames.new_zeros((t, rows * cols - n, h, w))), dim=1)
    frames = frames.clone()
    frames[:, :, [0, -1]] = 128  # thin grey border between tiles
    frames[:, :, :, [0, -1]] = 128
    grid = frames.view(t, rows, cols, h, w).permute(0, 1, 3, 2, 4).reshape(t, rows * h, cols * w)
    return grid.unsqueeze(-1).expand(-1, -1, -1, 3).cpu().numpy()


def has_fast_bf16(device: str) -> bool:
    """Whether bfloat16 math runs in hardware on `device` (emulated it is several times slower: docs/benchmarks.md)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch's own cpuinfo checks; a missing one: no
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)


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


def train_seeds(train, args) -> list:
    """`train(args)`: one seed per process here (`Args` refuses --num-seeds K > 1; the tensor scripts stack K)."""
    return [train(args)]


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
