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
Training uses `episodic_life` (a lost life ends the episode for the agent) and `reward_clip`
(rewards clipped to their sign); the scores we log are the real game scores: unclipped rewards
summed over all lives (see `GameStats`).

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
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import tyro


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    seed: int = 1
    """seed of the networks, the action sampling and the environments"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """torch device for the networks and the update (cuda when available, else cpu)"""
    torch_threads: int = 0
    """CPU threads for torch; 0 picks one per available core (ignored on GPU)"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "rl-ladder"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team); None uses your default"""
    capture_video: bool = False
    """save a 4x4 grid video of 16 envs' frames from the rollout every `video-interval` iterations"""
    video_interval: int = 100
    """iterations between two videos"""
    save_model: bool = False
    """save the agent's weights to the run folder at the end (also on Ctrl-C)"""
    eval_episodes: int = 4
    """whole games played by the final policy after training, without life loss or reward clipping (0 skips)"""
    progress_bar: bool = True
    """show a live progress bar with SPS and the recent game score"""
    async_envs: bool = False
    """step the envs asynchronously: EnvPool returns the first half of the envs that are ready while
    the other half is still being emulated, so the policy and the emulators overlap"""
    compile: bool = False
    """torch.compile the network (pays a one-off compile time)"""
    channels_last: bool = True
    """keep conv activations in channels-last memory layout (faster convolutions on CPU and GPU)"""
    bf16: bool = False
    """run the CNN trunk in bfloat16 autocast (AMX on recent Xeons, tensor cores on GPUs); the
    heads, the losses and the weights stay float32"""

    env_id: str = "Breakout-v5"
    """the EnvPool Atari game id, e.g. Breakout-v5, Pong-v5, SpaceInvaders-v5"""
    total_timesteps: int = 10_000_000
    """agent steps in total (each is 4 emulator frames)"""
    target_return: Optional[float] = None
    """stop once the mean score of the last 100 games reaches this (None: run all steps)"""
    learning_rate: float = 2.5e-4
    """Adam learning rate"""
    num_envs: int = 8
    """parallel game instances"""
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


class UsageError(ValueError):
    """A bad flag, an impossible combination of flags or a missing package: reported in one line."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite."""


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------
def make_env(env_id: str, num_envs: int, seed: int, batch_size: Optional[int] = None, train: bool = True):
    """An EnvPool Atari pool (gymnasium API). Training pools end episodes on a lost life and clip
    rewards; evaluation pools play whole games with the real rewards."""
    try:
        import envpool
    except ImportError:
        raise UsageError("this script needs envpool: pip install envpool==1.2.5") from None
    try:
        return envpool.make(
            env_id, env_type="gymnasium", num_envs=num_envs, batch_size=batch_size or num_envs, seed=seed,
            episodic_life=train, reward_clip=train,
        )  # fmt: skip
    except (AssertionError, KeyError):  # EnvPool asserts on unknown ids (KeyError under python -O)
        raise UsageError(f"unknown --env-id {env_id!r}: envpool.list_all_envs() lists the games (e.g. Pong-v5)") from None


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


def grid_video(frames: torch.Tensor) -> np.ndarray:
    """Frames (T, 4*84, 4*84, 3) uint8 of the first 16 envs of a rollout of stacked observations (T, N, 4, 84, 84)."""
    frames = frames[:, :16, -1]  # the newest frame of each stack
    t, n, h, w = frames.shape
    if n < 16:  # fewer than 16 envs: black tiles fill the grid
        frames = torch.cat((frames, frames.new_zeros((t, 16 - n, h, w))), dim=1)
    frames = frames.clone()
    frames[:, :, [0, -1]] = 128  # thin grey border between tiles
    frames[:, :, :, [0, -1]] = 128
    grid = frames.view(t, 4, 4, h, w).permute(0, 1, 3, 2, 4).reshape(t, 4 * h, 4 * w)
    return grid.unsqueeze(-1).expand(-1, -1, -1, 3).cpu().numpy()


# ----------------------------------------------------------------------------------------------
# Networks
# ----------------------------------------------------------------------------------------------
def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    """Orthogonal weights, constant bias (detail 2)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature CNN (Mnih et al. 2015) as a shared trunk, with actor and critic heads.

    Takes uint8 frames (B, 4, 84, 84) and scales them by 1/255 inside, so the rollout buffer stays uint8.
    With `bf16` the trunk runs in bfloat16 autocast and hands float32 features to the heads.
    """

    def __init__(self, num_actions: int, bf16: bool = False):
        super().__init__()
        self.bf16 = bf16
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
        )  # fmt: skip
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1.0)

    def forward(self, obs: torch.Tensor):
        """Logits and value of uint8 observations."""
        with torch.autocast(obs.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            hidden = self.network(obs.float() / 255.0)
        hidden = hidden.float()
        return self.actor(hidden), self.critic(hidden).squeeze(-1)

    def act(self, obs: torch.Tensor):
        """A sampled action, its log-probability and the value, for acting in the envs."""
        logits, value = self(obs)
        # Gumbel-max: argmax(logits + Gumbel noise) samples the softmax distribution
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
    """Clipped-surrogate PPO loss for one minibatch; returns (loss, detached statistics)."""
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
    stats = torch.stack((pg_loss, v_loss, entropy_loss, approx_kl, clipfrac, loss)).detach()
    return loss, stats


STAT_NAMES = ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl", "losses/clipfrac", "losses/total_loss")


def evaluate_games(agent: Agent, args: Args, device: torch.device, memory_format) -> list[float]:
    """Scores of `--eval-episodes` whole games (no life loss, raw rewards) under the sampling policy."""
    envs = make_env(args.env_id, args.eval_episodes, args.seed + 1, train=False)
    obs, _ = envs.reset()
    scores = np.zeros(args.eval_episodes)
    finished = np.zeros(args.eval_episodes, dtype=bool)
    with torch.inference_mode():
        while not finished.all():
            obs_t = torch.from_numpy(obs).to(device).contiguous(memory_format=memory_format)
            action, _, _ = agent.act(obs_t)
            obs, reward, terminated, truncated, info = envs.step(action.cpu().numpy())
            scores += np.where(finished, 0.0, info["reward"])
            finished |= terminated | truncated
    envs.close()
    return scores.tolist()


def validate(args: Args) -> torch.device:
    """Reject bad flags with one clear line (raised as UsageError); return the torch device."""
    positive = ("num_envs", "num_steps", "total_timesteps", "num_minibatches", "update_epochs", "video_interval")
    for name in positive:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.eval_episodes < 0 or args.torch_threads < 0:
        raise UsageError("--eval-episodes and --torch-threads must be >= 0")
    batch_size = args.num_envs * args.num_steps
    if batch_size < args.num_minibatches:
        raise UsageError(f"--num-envs * --num-steps = {batch_size} is fewer than --num-minibatches {args.num_minibatches}")
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
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"unknown --device {args.device!r}; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA GPU is available; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device} is not supported; use cpu or cuda")
    for flag, module, pin in (("capture_video", "moviepy", "moviepy==2.2.1"), ("track", "wandb", "wandb==0.31.0")):
        if getattr(args, flag):
            try:
                __import__(module)
            except ImportError:
                raise UsageError(f"--{flag.replace('_', '-')} needs {module}: pip install {pin}") from None
    return device


def write_video(frames: np.ndarray, path: str, fps: int = 15) -> None:
    from moviepy import ImageSequenceClip

    ImageSequenceClip(list(frames), fps=fps).write_videofile(path, codec="libx264", audio=False, logger=None)


def train(args: Args) -> Agent:
    """Train PPO on the `--env-id` game and return the agent.

    Writes TensorBoard events and summary.json to runs/<run>; re-raises KeyboardInterrupt after
    writing everything, and raises NonFiniteLossError when the loss stops being finite.
    """
    device = validate(args)
    if device.type == "cpu":
        torch.set_num_threads(args.torch_threads or len(os.sched_getaffinity(0)))
    # async: EnvPool hands back the first half of the envs that are ready while it emulates the rest
    env_batch = args.num_envs // 2 if args.async_envs else args.num_envs
    envs = make_env(args.env_id, args.num_envs, args.seed, batch_size=env_batch)
    batch_size = args.num_envs * args.num_steps
    num_iterations = args.total_timesteps // batch_size
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = os.path.join("runs", run_name)

    from torch.utils.tensorboard import SummaryWriter

    if args.track:
        import wandb

        wandb.init(
            project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
            config=asdict(args), name=run_name, save_code=True,
        )  # fmt: skip
    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))

    torch.manual_seed(args.seed)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    agent = Agent(envs.single_action_space.n, bf16=args.bf16).to(device, memory_format=memory_format)
    if args.compile:  # compile the forward pass only, so the weights keep their plain names
        agent.forward = torch.compile(agent.forward)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)  # eps: detail 3

    # Rollout storage, one column per env, filled in each env's own order. In async mode envs come
    # back in any order: every env fills its column up to row T (T steps plus the observation to
    # bootstrap from). An env that gets there first is parked (its action is held back until the
    # next rollout) as long as enough envs stay in flight for EnvPool to fill a batch; the few rows
    # an env still runs past T are kept for the next rollout.
    T, N = args.num_steps, args.num_envs
    rows = 2 * T + 1  # room for envs that run ahead
    obs_buf = torch.zeros((rows, N, 4, 84, 84), dtype=torch.uint8, device=device)
    actions_buf = torch.zeros((rows, N), dtype=torch.long, device=device)
    logprobs_buf = torch.zeros((rows, N), device=device)
    values_buf = torch.zeros((rows, N), device=device)
    rewards_buf = torch.zeros((rows, N), device=device)
    terminated_buf = torch.zeros((rows, N), dtype=torch.bool, device=device)
    dones_buf = torch.zeros_like(terminated_buf)
    valid_buf = torch.zeros_like(terminated_buf)  # False for the reset step that follows a done
    filled = np.zeros(N, dtype=np.int64)  # rows filled per env
    parked = np.zeros(N, dtype=bool)  # envs whose last action waits for the next rollout
    game_stats = GameStats(N)

    recent_scores: deque[float] = deque(maxlen=100)
    global_step, status, games = 0, "error", 0
    progress = None
    if args.progress_bar:
        from tqdm import tqdm

        progress = tqdm(total=num_iterations * batch_size, unit="step", unit_scale=True, dynamic_ncols=True)
    envs.async_reset()
    start_time = time.perf_counter()
    try:
        for iteration in range(1, num_iterations + 1):
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate

            finished_games = []
            if parked.any():
                ids = np.flatnonzero(parked)
                envs.send(actions_buf[filled[ids] - 1, ids].cpu().numpy(), ids.astype(np.int32))
                parked[:] = False
            while filled.min() < T + 1:
                obs, reward, terminated, truncated, info = envs.recv()
                ids, done = info["env_id"], terminated | truncated
                row = filled[ids]
                if row.max() >= rows:
                    raise RuntimeError("an async env ran more than a rollout ahead of the others")
                # this step's reward and flags belong to each env's previous row (absent right after the first reset)
                prev = row > 0
                prev_rows, prev_ids = torch.from_numpy(row[prev] - 1), torch.from_numpy(ids[prev])
                rewards_buf[prev_rows, prev_ids] = torch.from_numpy(reward[prev]).to(device)
                terminated_buf[prev_rows, prev_ids] = torch.from_numpy(terminated[prev]).to(device)
                dones_buf[prev_rows, prev_ids] = torch.from_numpy(done[prev]).to(device)
                finished_games += game_stats.update(ids, info["reward"], (info["terminated"] == 1) | truncated, info["elapsed_step"])

                obs_t = torch.from_numpy(obs).to(device)
                with torch.inference_mode():
                    action, logprob, value = agent.act(obs_t.contiguous(memory_format=memory_format))
                # park envs that have their T+1 rows, keeping at least a batch of envs in flight
                done_rows = row + 1 >= T + 1
                room = N - env_batch - int(parked.sum())
                park = done_rows & (np.cumsum(done_rows) <= room)
                parked[ids[park]] = True
                if not park.all():
                    envs.send(action.cpu().numpy()[~park], ids[~park])
                row_t, ids_t = torch.from_numpy(row), torch.from_numpy(ids)
                obs_buf[row_t, ids_t] = obs_t
                actions_buf[row_t, ids_t] = action
                logprobs_buf[row_t, ids_t] = logprob
                values_buf[row_t, ids_t] = value
                # an env that has just reported done spends its next step resetting, whatever the action
                valid_buf[row_t, ids_t] = torch.from_numpy(~done).to(device)
                filled[ids] += 1
                global_step += int(prev.sum())  # steps emulated; the first recv after the reset is none

            with torch.no_grad():
                # rows 0..T-1 are complete steps; row T holds each env's next observation and its value
                advantages, returns = compute_gae(
                    rewards_buf[:T], values_buf[:T], values_buf[1 : T + 1], terminated_buf[:T], dones_buf[:T],
                    args.gamma, args.gae_lambda,
                )  # fmt: skip
                valid = valid_buf[:T].reshape(-1)
                b_obs = obs_buf[:T].reshape(-1, 4, 84, 84)[valid]
                b_actions = actions_buf[:T].reshape(-1)[valid]
                b_logprobs = logprobs_buf[:T].reshape(-1)[valid]
                b_values = values_buf[:T].reshape(-1)[valid]
                b_advantages, b_returns = advantages.reshape(-1)[valid], returns.reshape(-1)[valid]
            video_frames = obs_buf[:T].clone() if args.capture_video and (iteration - 1) % args.video_interval == 0 else None
            # keep the rows of envs that ran ahead (and row T, the start of every env's next rollout)
            for buf in (obs_buf, actions_buf, logprobs_buf, values_buf, rewards_buf, terminated_buf, dones_buf, valid_buf):
                buf[: rows - T] = buf[T:].clone()
            filled -= T

            n_valid = len(b_actions)
            stats = torch.zeros(len(STAT_NAMES), device=device)
            updates = 0
            for _ in range(args.update_epochs):
                # minibatches of the valid steps (their count varies a little: reset steps are left out)
                perm = torch.randperm(n_valid, device=device)
                for mb in perm.tensor_split(args.num_minibatches):
                    loss, mb_stats = ppo_loss(
                        agent, args, b_obs[mb].contiguous(memory_format=memory_format), b_actions[mb], b_logprobs[mb],
                        b_advantages[mb], b_returns[mb], b_values[mb],
                    )  # fmt: skip
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()
                    stats += mb_stats
                    epoch_kl = mb_stats[3]
                    updates += 1
                if args.target_kl is not None and epoch_kl.item() > args.target_kl:
                    break

            # the host reads of the iteration, for logging
            explained_var = 1 - (b_returns - b_values).var() / b_returns.var()
            *stats, explained_var = torch.cat((stats / updates, explained_var.view(1))).tolist()
            if not all(math.isfinite(v) for v in stats):
                status = "non-finite loss"
                raise NonFiniteLossError(f"non-finite loss at iteration {iteration} (env step {global_step})")
            recent_scores.extend(score for score, _ in finished_games)
            games += len(finished_games)
            elapsed = time.perf_counter() - start_time
            sps = int(global_step / elapsed)
            mean_recent = float(np.mean(recent_scores)) if recent_scores else float("nan")

            if finished_games:
                writer.add_scalar("charts/episodic_return", float(np.mean([s for s, _ in finished_games])), global_step)
                writer.add_scalar("charts/episodic_length", float(np.mean([n for _, n in finished_games])), global_step)
            writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
            writer.add_scalar("charts/SPS", sps, global_step)
            for name, value in zip(STAT_NAMES, stats):
                writer.add_scalar(name, value, global_step)
            writer.add_scalar("losses/explained_variance", explained_var, global_step)
            if progress is not None:
                progress.update(batch_size)
                progress.set_postfix(SPS=sps, score=f"{mean_recent:.1f}", refresh=False)

            if video_frames is not None:
                os.makedirs(os.path.join(run_dir, "videos"), exist_ok=True)
                video_path = os.path.join(run_dir, "videos", f"rollout_iter{iteration:05d}.mp4")
                write_video(grid_video(video_frames), video_path)
                if args.track:
                    wandb.log({"videos/rollout": wandb.Video(video_path, format="mp4")})

            if args.target_return is not None and len(recent_scores) == 100 and mean_recent >= args.target_return:
                status = "target return reached"
                break
        else:
            status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        if progress is not None:
            progress.close()
        elapsed = time.perf_counter() - start_time
        summary = {
            "env_id": args.env_id,
            "exp_name": args.exp_name,
            "seed": args.seed,
            "device": str(device),
            "async_envs": args.async_envs,
            "status": status,
            "total_env_steps": global_step,
            "wall_seconds": round(elapsed, 3),
            "mean_sps": round(global_step / elapsed, 1) if elapsed > 0 else 0.0,
            "games": games,
            "mean_return_last_100": float(np.mean(recent_scores)) if recent_scores else None,
        }
        envs.close()
        if status != "non-finite loss":  # NaN weights are not worth saving
            if args.save_model:
                model_path = os.path.join(run_dir, f"{args.exp_name}.cleanrl_model")
                torch.save(agent.state_dict(), model_path)
                summary["model_path"] = model_path
            if args.eval_episodes and status in ("completed", "target return reached"):
                eval_returns = evaluate_games(agent, args, device, memory_format)
                summary["eval_returns"] = eval_returns
                summary["eval_mean_return"] = float(np.mean(eval_returns))
                writer.add_scalar("eval/episodic_return", summary["eval_mean_return"], global_step)
        summary["args"] = asdict(args)
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(
            f"{status}: {global_step:,} steps in {elapsed:.1f} s ({summary['mean_sps']:,.0f} SPS); "
            f"mean score of the last 100 games {summary['mean_return_last_100']} ({games} games); "
            f"evaluation {summary.get('eval_mean_return', 'skipped')}; outputs in {run_dir}"
        )
        writer.close()
        if args.track:
            wandb.finish()
    if status == "interrupted":
        raise KeyboardInterrupt
    return agent


def main() -> None:
    args = tyro.cli(Args)
    try:
        train(args)
    except UsageError as e:
        sys.exit(f"error: {e}")
    except NonFiniteLossError as e:
        sys.exit(f"error: {e}; lower --learning-rate or --max-grad-norm")
    except KeyboardInterrupt:
        print("interrupted: logs and summary.json written (and the model, with --save-model)", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
