"""PPO on Atari through EnvPool 1.x (C++ emulators), with the Nature CNN.

CleanRL's ppo_atari_envpool.py, rebuilt for today's stack: envpool 1.x (gymnasium's 5-tuple API,
Python >= 3.11, numpy 2), torch and tyro. The emulators run in EnvPool's C++ thread pool; the
policy and the update run on `--device` (cuda when a GPU is there, else the CPU).

Run:
    python ppo_atari_envpool.py                              # Breakout-v5, CleanRL's Atari defaults
    python ppo_atari_envpool.py --env-id Pong-v5 --async-envs
    python ppo_atari_envpool.py --total-timesteps 20000 --capture-video --save-model
    tensorboard --logdir runs

Environment (EnvPool's Atari defaults, the preprocessing of Mnih et al. 2015 / Machado et al. 2018):
frame skip 4 with max-pooling of the last two frames, 84x84 grayscale, a stack of the last 4
frames, up to 30 no-op actions after a reset, FIRE pressed on reset where the game needs it, no
sticky actions, the minimal action set, 27000 agent steps (108k frames) per game at most.
Training and evaluation use `episodic_life` (a lost life ends the episode for the agent, and the
reset that follows presses FIRE) and `reward_clip` (rewards clipped to their sign); the scores we
log are the real game scores: unclipped rewards summed over all lives (see `GameStats`).

EnvPool resets an env on the step *after* it reported done: that step returns the new episode's
first observation, reward 0, and ignores the action it was given. We store that step like any
other but mask it out of the loss, and GAE cuts its recursion at every done, so no transition of
one episode leaks into the next. Because the observation returned with done is the episode's real
last frame, a game cut by the step limit is bootstrapped from its value (truncation is not failure).

The update (Schulman et al. 2017; details numbered as in Huang et al. 2022, "The 37 Implementation
Details of PPO"):
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

import difflib
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from enum import Enum
from typing import NamedTuple, Optional

# libgomp's OpenMP threads wait for work by spinning, which starves our own threads whenever another program keeps
# a core busy (4x slower beside one CPU hog on 2 cores); sleeping instead costs little. It must be set before torch
# loads OpenMP; a value you export wins. README: "Threads and a busy machine".
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro


@dataclass
class Args:
    # Algorithm
    env_id: str = "Breakout-v5"
    """the EnvPool Atari game id, e.g. Breakout-v5, Pong-v5, SpaceInvaders-v5"""
    total_timesteps: int = 10_000_000
    """agent steps in total, all torchrun ranks together (each is 4 emulator frames);
    CleanRL's 10M take 5-11 h on a 2-core CPU (250-540 SPS): a note after 3 iterations gives the estimate"""
    target_return: Optional[float] = None
    """stop once the mean score of the last 100 games reaches this (None: run all steps)"""
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

    # Run management and logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    seed: int = 1
    """seed of the networks, the action sampling and the environments"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """torch device for the networks and the update (cuda when available, else cpu)"""
    torch_threads: int = 0
    """CPU threads for torch; 0 picks one per available core (ignored on GPU)"""
    async_envs: bool = False
    """step the envs asynchronously: EnvPool returns the first half of the envs that are ready while
    the other half is still being emulated, so the policy and the emulators overlap"""
    compile: bool = False
    """torch.compile the network (pays a one-off compile time)"""
    channels_last: bool = True
    """keep conv activations in channels-last memory layout
    (faster convolutions: 1.27x on a 2-core Intel Xeon, 1.07-1.27x on a 2-core AMD EPYC; README "Atari")"""
    bf16: bool = False
    """run the CNN trunk in bfloat16 autocast (the heads, losses and weights stay float32);
    needs bf16 hardware, refused elsewhere: AMX/AVX512-BF16 CPUs (Xeons from Sapphire Rapids on), Ampere+ GPUs"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "rl-ladder"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team); None uses your default"""
    capture_video: bool = False
    """save a grid video of up to 16 envs' frames from the rollout every `video-interval` iterations"""
    video_interval: int = 100
    """iterations between two videos, the first at iteration 1 (0: no videos during training)"""
    save_model: bool = False
    """save the agent's weights to the run folder at the end (also on Ctrl-C)"""
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
    eval_episodes: int = 4
    """whole games played by the final policy after training, scored with the real rewards (0 skips)"""
    progress_bar: bool = True
    """show a live progress bar with SPS and the recent game score"""


DATA_PARALLEL = True  # runs under torchrun, one process per GPU or CPU share (README: "Scaling out")
THREADED_FROM_ENVS = 0  # one torch thread per core at any env count: the CNN's convolutions are large


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
def make_env(env_id: str, num_envs: int, seed: int, batch_size: Optional[int] = None):
    """An EnvPool Atari pool (gymnasium API) with the training settings: episodes end on a lost life
    and rewards are clipped (`info["reward"]` keeps the raw ones). `recv` hands back `batch_size` envs."""
    import envpool

    return envpool.make(
        env_id, env_type="gymnasium", num_envs=num_envs, batch_size=batch_size or num_envs, seed=seed,
        episodic_life=True, reward_clip=True,
    )  # fmt: skip


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


# ----------------------------------------------------------------------------------------------
# Agent
# ----------------------------------------------------------------------------------------------
def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    """Orthogonal weights, constant bias (detail 2)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature CNN (Mnih et al. 2015) as a shared trunk, with actor and critic heads.

    Takes uint8 frames (B, 4, 84, 84) and scales them by 1/255 inside, so the rollout buffer stays uint8.
    With `channels_last` the convolutions run in channels-last memory layout, with `bf16` the trunk runs
    in bfloat16 autocast and hands float32 features to the heads.
    """

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
        if greedy:
            action = logits.argmax(-1)
        else:  # Gumbel-max: argmax(logits + Gumbel noise) samples the softmax distribution
            action = (logits - torch.empty_like(logits).exponential_().log()).argmax(-1)
        logprob = logits.log_softmax(-1).gather(-1, action.unsqueeze(-1)).squeeze(-1)
        return action, logprob, value

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor):
        """Log-probability of `action`, entropy, and value."""
        logits, value = self(obs)
        logp = logits.log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, action.unsqueeze(-1)).squeeze(-1), entropy, value


# ----------------------------------------------------------------------------------------------
# Algorithm
# ----------------------------------------------------------------------------------------------
class Rollout(NamedTuple):
    """Every env's steps in its own column, in that env's order, and the pool's bookkeeping.

    Rows 0..T-1 of a column are the rollout's T steps and row T the observation to bootstrap from (also
    the next rollout's row 0). In async mode envs come back in any order, and an env may run past row T
    while the others catch up: hence 2T+1 rows. Tensors (2T+1, N) on the device.
    """

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
        def zeros(*shape, dtype=torch.float32):
            return torch.zeros((2 * num_steps + 1, num_envs, *shape), dtype=dtype, device=device)

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

    EnvPool hands back `env_batch` envs per `recv` (all of them in sync mode), in any order. A step's reward
    and flags arrive with the next observation, so they go to the env's previous row. An env that has its
    T+1 rows is parked (its last action waits for the next rollout) as long as `env_batch` envs stay in
    flight for EnvPool to fill a batch; the rows an env still runs past T are kept for the next rollout.
    """
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
    """Generalised advantage estimation over a (T, N) rollout; returns (advantages, returns).

    `next_values[t]` is V of the observation that followed step t (with EnvPool, the episode's real
    last frame when it ended), so a truncated game is bootstrapped and only `terminated` zeroes the
    future. `dones` (terminated or truncated) cuts the recursion at every episode boundary.
    """
    deltas = rewards + gamma * next_values * (~terminated).to(values.dtype) - values
    decay = gamma * gae_lambda * (~dones).to(values.dtype)
    advantages = torch.empty_like(deltas)
    lastgaelam = torch.zeros_like(deltas[0])
    for t in reversed(range(deltas.shape[0])):
        lastgaelam = deltas[t] + decay[t] * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def ppo_loss(agent: Agent, args: Args, obs, actions, old_logprobs, advantages, returns, old_values):
    """Clipped-surrogate PPO loss for one minibatch; returns (loss, statistics keyed by TensorBoard tag)."""
    newlogprob, entropy, newvalue = agent.evaluate(obs, actions)
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


def update(agent: Agent, optimizer: torch.optim.Optimizer, batch: Batch, args: Args) -> dict[str, torch.Tensor]:
    """`update-epochs` passes over the batch in shuffled minibatches (detail 6; `tensor_split`, as the number of
    valid steps varies a little), each step with global gradient clipping (detail 11), ending early once the
    approximate KL exceeds `target-kl`. Returns the mean of each loss statistic and the explained variance."""
    history = []
    for _ in range(args.update_epochs):
        for idx in torch.randperm(len(batch.actions), device=batch.actions.device).tensor_split(args.num_minibatches):
            loss, stats = ppo_loss(agent, args, *(x[idx] for x in batch))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients(agent)  # data parallel under torchrun: the mean gradient over the ranks
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
            history.append(stats)
        # a host read per epoch; under torchrun the ranks judge their mean KL, so they stop together
        if args.target_kl is not None and mean_over_ranks(stats["losses/approx_kl"]) > args.target_kl:
            break
    means = {tag: torch.stack([stats[tag] for stats in history]).mean() for tag in history[0]}
    return means | {"losses/explained_variance": explained_variance(batch.values, batch.returns)}


def train(args: Args) -> Agent:
    """Train PPO on the `--env-id` game and return the agent.

    `Run` writes the outputs; Ctrl-C (KeyboardInterrupt) and a non-finite loss end the run with everything written.
    """
    device = torch.device(args.device)
    T, N = args.num_steps, args.num_envs
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
        rollout = Rollout.empty(T, N, device)
        envs.async_reset()
        # with --resume: agent, optimizer, RNGs and counters as the checkpoint left them (the games start afresh)
        run.start(agent, envs, optimizer, total_steps=num_iterations * T * N * run.world_size)
        for iteration in range(run.iteration + 1, num_iterations + 1):
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
            env_steps = collect_rollout(agent, envs, rollout, env_batch)
            # rows 0..T-1 are complete steps; row T holds each env's next observation and its value
            advantages, returns = compute_gae(rollout.rewards[:T], rollout.values[:T], rollout.values[1 : T + 1],
                                              rollout.terminated[:T], rollout.dones[:T],
                                              args.gamma, args.gae_lambda)  # fmt: skip
            valid = rollout.valid[:T].flatten()  # the reset steps are left out of the loss
            b_obs, b_actions, b_logprobs, b_values = (x[:T].flatten(0, 1)[valid] for x in rollout[:4])
            batch = Batch(b_obs, b_actions, b_logprobs, advantages.flatten()[valid], returns.flatten()[valid], b_values)
            stats = update(agent, optimizer, batch, args)
            if run.log(env_steps, stats, rollout):  # True once the target return is reached
                break
    return agent


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
        """(ended, return, length), tensors of one shape: the games that ended during `rollout`, with their
        real scores (unclipped rewards over all lives, see `GameStats`)."""
        games = torch.tensor(rollout.games, dtype=torch.float32, device=self.device).view(-1, 2)
        return torch.ones(len(games), dtype=torch.bool, device=self.device), games[:, 0], games[:, 1]

    def evaluate(self) -> list[float]:
        """Real score of one whole game in each of `eval-episodes` fresh envs under the sampling policy, drawing
        from its own seeded random stream (so --eval-only on the saved model plays the same games); with
        --capture-video, a grid video of (up to 16 of) the games at their real speed, 15 agent steps (60
        frames) a second, each held on its last frame once over (uploaded with --track).

        The envs lose lives as in training: after each lost life EnvPool's reset presses FIRE, which the
        agent never learned to do (without it Breakout waits for FIRE until the 27000-step limit). A
        game is over when its last life is lost or at the step limit; its score is the raw rewards' sum.
        """
        n = self.args.eval_episodes
        envs = make_env(self.args.env_id, n, self.args.seed + 1)
        game_stats, scores = GameStats(n), np.full(n, np.nan)
        video = VideoStream(os.path.join(self.dir, "videos", "evaluation.mp4"), 15) if self.args.capture_video else None
        obs, info = envs.reset()
        ids = info["env_id"]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.args.seed + 1)
            while np.isnan(scores).any():
                if video is not None:  # the envs in id order, the finished ones held still
                    video.add(torch.from_numpy(obs[np.argsort(ids)][:16]), playing=np.isnan(scores[:16]))
                with torch.inference_mode():
                    action, _, _ = self.agent.get_action(torch.from_numpy(obs).to(self.device))
                obs, _, _, truncated, info = envs.step(action.cpu().numpy(), ids)
                ids, over = info["env_id"], game_over(info, truncated)
                games = game_stats.update(ids, info["reward"], over, info["elapsed_step"])
                for env, (score, _) in zip(ids[over], games):
                    if np.isnan(scores[env]):  # each env's first game: later ones would favour short games
                        scores[env] = score
        envs.close()
        if video is not None:
            video.close()
            if self.wandb is not None:
                self.wandb.log({"videos/evaluation": self.wandb.Video(video.path, format="mp4")})
        return scores.tolist()

    def envs_state(self) -> None:
        """EnvPool's emulators cannot be saved: a resumed run starts new games."""
        return None

    def restore_envs(self, saved: None, obs):
        self.note("EnvPool's emulators are not in a checkpoint: the envs start new games")
        return obs

    def record_video(self, rollout: Rollout, iteration: int) -> str:
        """A grid video of up to 16 envs' frames from `rollout`'s T steps; returns its path."""
        path = os.path.join(self.dir, "videos", f"rollout_iter{iteration:05d}.mp4")
        write_video(grid_video(rollout.obs[: len(rollout.obs) // 2]), path, fps=15)
        return path


class VideoStream:
    """A grid video written frame by frame as it plays (a whole game can be tens of thousands of frames)."""

    def __init__(self, path: str, fps: int):
        self.path, self.fps, self.writer, self.last = path, fps, None, None

    def add(self, frames: torch.Tensor, playing: np.ndarray) -> None:
        """One step of up to 16 envs' stacked observations (n, 4, 84, 84); those not `playing` keep their last frame."""
        if self.last is not None:
            frames = torch.where(torch.from_numpy(playing).view(-1, 1, 1, 1), frames, self.last)
        self.last = frames
        frame = grid_video(frames[None])[0]
        if self.writer is None:
            from moviepy.video.io.ffmpeg_writer import FFMPEG_VideoWriter

            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.writer = FFMPEG_VideoWriter(self.path, (frame.shape[1], frame.shape[0]), self.fps)
        self.writer.write_frame(frame)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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
    positive = ("num_envs", "num_steps", "total_timesteps", "num_minibatches", "update_epochs")
    for name in positive:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.eval_episodes < 0 or args.torch_threads < 0 or args.video_interval < 0:
        raise UsageError("--eval-episodes, --torch-threads and --video-interval must be >= 0")
    batch_size = args.num_envs * args.num_steps
    if batch_size < args.num_minibatches:
        raise UsageError(
            f"--num-envs * --num-steps = {batch_size} is fewer than --num-minibatches {args.num_minibatches}"
        )
    if args.total_timesteps < batch_size:
        raise UsageError(f"--total-timesteps {args.total_timesteps} is smaller than one rollout ({batch_size} steps)")
    if args.async_envs and args.num_envs < 2:
        raise UsageError("--async-envs needs --num-envs >= 2 (half of them are emulated while the policy acts)")
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
    try:
        import envpool
    except ImportError:
        raise UsageError("this script needs envpool: pip install envpool==1.2.5") from None
    if args.env_id not in envpool.list_all_envs():
        raise UsageError(f"unknown --env-id {args.env_id!r}: envpool.list_all_envs() lists the games (e.g. Pong-v5)")
    if type(envpool.make_spec(args.env_id)).__name__ != "AtariEnvSpec":
        raise UsageError(f"--env-id {args.env_id} is not an Atari game (e.g. Breakout-v5, Pong-v5)")
    device = validate_run_flags(args)
    if args.bf16 and not has_fast_bf16(device):
        kind = "GPU" if device.type == "cuda" else "CPU"
        raise UsageError(f"--bf16: this {kind} has no bfloat16 hardware (AMX or AVX512-BF16 CPUs, GPUs from Ampere "
                         "on) and would emulate it several times slower; leave out --bf16")  # fmt: skip
    return device


def has_fast_bf16(device: torch.device) -> bool:
    """Whether bfloat16 math runs in hardware on `device` (measured on a CPU without it: 6.5x slower, README)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch's own cpuinfo checks; a missing one: no
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)


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
