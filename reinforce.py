"""REINFORCE (Williams 1992) with reward-to-go returns on the tensor CartPole.

The first rung of the ladder (reinforce.py -> vpg.py -> ppo_cartpole_gpu.py): a policy network
alone, pushed towards the actions that were followed by high returns. The environment, rollout
and update all live on one device (`--device cuda` when a GPU is there, else the CPU).

Run:
    python reinforce.py                             # defaults: solves CartPole on a laptop CPU
    python reinforce.py --no-normalize-returns      # raw returns: watch the variance
    tensorboard --logdir runs

The update, one gradient step per rollout:
    G_t  = r_t + γ G_{t+1} (1 - done_t)             the discounted reward-to-go of step t
    L    = -E[ log π_θ(a_t|s_t) Ĝ_t ] - c_ent H[π_θ]
where Ĝ is G normalised to zero mean and unit std over the batch (`--normalize-returns`), a
crude baseline that vpg.py replaces with a learned one.

A return needs the rest of its episode. Every rollout therefore starts with a reset of all envs
and runs until each env has finished at least one episode (or `--num-steps` steps, which by
default is the 500-step limit, so that always happens). Steps after an env's last finished
episode have no complete return: they are dropped from the loss. There is no critic to bootstrap
with, so an episode cut at 500 steps counts with the return it has.
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
    """torch device to run everything on (cuda when available, else cpu)"""
    torch_threads: int = 0
    """CPU threads for torch; 0 picks one per available core (ignored on GPU)"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "rl-ladder"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team); None uses your default"""
    capture_video: bool = False
    """save a 4x4 grid video of 16 envs from the rollout every `video-interval` iterations"""
    video_interval: int = 25
    """iterations between two videos"""
    save_model: bool = False
    """save the agent's weights to the run folder at the end (also on Ctrl-C)"""
    eval_episodes: int = 10
    """greedy-policy episodes evaluated after training (0 skips the evaluation)"""
    progress_bar: bool = True
    """show a live progress bar with SPS and the recent return"""

    env_id: str = "CartPole-v1"
    """the environment: CartPole-v1, EasyCart-v1 (shaped reward) or SpinCart-v1 (spin the pole)"""
    total_timesteps: int = 5_000_000
    """upper bound on environment steps (training may stop earlier, see `target-return`)"""
    target_return: Optional[float] = 500.0
    """stop once the mean return of the last 100 episodes reaches this (None: run all steps;
    the shaped envs never reach 500)"""
    learning_rate: float = 5e-3
    """Adam learning rate"""
    num_envs: int = 128
    """parallel environments"""
    num_steps: int = 500
    """most steps per environment per rollout, at least the episode limit (a rollout ends early
    once every env has finished an episode)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    gamma: float = 0.99
    """discount factor"""
    normalize_returns: bool = True
    """normalise the returns to zero mean and unit std over the batch"""
    ent_coef: float = 0.0
    """entropy bonus coefficient"""
    max_grad_norm: float = 0.5
    """global gradient-norm clipping"""


SOLVED_RETURN = 475.0
"""CartPole-v1's reward threshold: summary.json records when the 100-episode mean first reaches it"""


class UsageError(ValueError):
    """A bad flag or an impossible combination of flags: reported in one line."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite."""


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------
class CartPole:
    """Gymnasium's CartPole-v1, vectorised over `num_envs` in float32 torch ops on `device`.

    Interface (every env the trainer takes, probes included, has it):
      num_envs, obs_dim, num_actions, max_episode_steps, device
      reset() -> (obs, info)
      step(actions) -> (obs, reward, terminated, truncated, info)
    Finished envs are reset inside `step`. `info` then holds, per env and valid where
    terminated | truncated: "final_obs" (the real last observation), "episode_return",
    "episode_length".
    """

    gravity = 9.8
    masscart = 1.0
    masspole = 0.1
    total_mass = masscart + masspole
    length = 0.5  # half the pole's length
    polemass_length = masspole * length
    force_mag = 10.0
    tau = 0.02  # seconds between state updates
    x_threshold = 2.4
    theta_threshold_radians = 12 * 2 * math.pi / 360
    max_episode_steps = 500
    obs_dim = 4
    num_actions = 2

    def __init__(self, num_envs: int, device: torch.device | str = "cpu", seed: int = 0):
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        # On a GPU, reading which envs finished would stall the stream (see `_autoreset`).
        self.sync_free_reset = self.device.type != "cpu"
        self.state = self._initial_states(num_envs)
        self.episode_return = torch.zeros(num_envs, device=self.device)
        self.episode_length = torch.zeros(num_envs, dtype=torch.int32, device=self.device)

    def _initial_states(self, n: int) -> torch.Tensor:
        # stored feature-major, (4, n) in memory and seen as (n, 4): see `step`
        return torch.empty(4, n, device=self.device).uniform_(-0.05, 0.05, generator=self.generator).T

    def reset(self):
        self.state = self._initial_states(self.num_envs)
        self.episode_return.zero_()
        self.episode_length.zero_()
        return self.state, {}

    def reward_function(self, action: torch.Tensor) -> torch.Tensor:
        """+1 for every step, the one that ends the episode included (as gymnasium)."""
        return torch.ones_like(self.state[:, 0])

    def terminated(self) -> torch.Tensor:
        x, theta = self.state[:, 0], self.state[:, 2]
        return (x.abs() > self.x_threshold) | (theta.abs() > self.theta_threshold_radians)

    def step(self, action: torch.Tensor):
        x, x_dot, theta, theta_dot = self.state.unbind(1)
        force = action * (2 * self.force_mag) - self.force_mag  # action 1 pushes right, 0 left
        costheta, sintheta = torch.cos(theta), torch.sin(theta)
        # gymnasium's equations; addcmul(a, b, c, value=v) = a + v*b*c saves kernels
        temp = torch.addcmul(force, theta_dot.square(), sintheta, value=self.polemass_length) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole / self.total_mass * costheta.square())
        )
        xacc = torch.addcmul(temp, thetaacc, costheta, value=-self.polemass_length / self.total_mass)
        # Explicit Euler, as gymnasium's default kinematics_integrator="euler". The state is kept
        # feature-major ((4, N) in memory, seen as (N, 4)) so x, x_dot, ... are contiguous rows:
        # elementwise ops on them are faster and stacking rows is ~9x cheaper than stacking columns.
        derivatives = torch.stack((x_dot, xacc, theta_dot, thetaacc))
        self.state = torch.add(self.state.T, derivatives, alpha=self.tau).T

        terminated = self.terminated()
        reward = self.reward_function(action)
        self.episode_return = self.episode_return + reward
        self.episode_length = self.episode_length + 1
        truncated = self.episode_length >= self.max_episode_steps
        done = terminated | truncated
        info = {"final_obs": self.state, "episode_return": self.episode_return, "episode_length": self.episode_length}
        self._autoreset(done)
        return self.state, reward, terminated, truncated, info

    def _autoreset(self, done: torch.Tensor) -> None:
        """Give finished envs fresh initial states, out of place (info["final_obs"] keeps the old)."""
        if self.sync_free_reset:
            # draw for every env and keep the draws where done: no host read of `done`
            self.state = torch.where(done.unsqueeze(1), self._initial_states(self.num_envs), self.state)
        else:
            # no stream to stall on the CPU: draw for the finished envs only (~4x cheaper here)
            idx = done.nonzero().squeeze(1)
            self.state = self.state.index_put((idx,), self._initial_states(idx.numel()))
        self.episode_return = self.episode_return.masked_fill(done, 0.0)
        self.episode_length = self.episode_length.masked_fill(done, 0)


class EasyCart(CartPole):
    """Shaped reward in [0, 1]: half for an upright pole, half for a centred cart."""

    def reward_function(self, action: torch.Tensor) -> torch.Tensor:
        x, theta = self.state[:, 0], self.state[:, 2]
        upright = 1.0 - theta.abs() / self.theta_threshold_radians
        centred = 1.0 - x.abs() / self.x_threshold
        return (0.5 * (upright + centred)).clamp(0.0, 1.0)


class SpinCart(CartPole):
    """Reward for spinning the pole fast while the cart stays centred and slow.

    The pole may turn all the way round: only leaving the track ends an episode.
    """

    def reward_function(self, action: torch.Tensor) -> torch.Tensor:
        x, x_dot, theta_dot = self.state[:, 0], self.state[:, 1], self.state[:, 3]
        spin = (0.1 * theta_dot.abs()).clamp(max=1.0)
        drift = (x / self.x_threshold).abs() + (x_dot / 10.0).abs()
        return spin - 0.5 * drift.clamp(max=1.0)

    def terminated(self) -> torch.Tensor:
        return self.state[:, 0].abs() > self.x_threshold


ENVS = {"CartPole-v1": CartPole, "EasyCart-v1": EasyCart, "SpinCart-v1": SpinCart}


def draw(states: torch.Tensor, width: int = 150, height: int = 100) -> torch.Tensor:
    """Render CartPole states (..., 4) as RGB frames (..., height, width, 3) uint8, in tensor ops.

    Same picture as gymnasium's renderer (track, black cart, brown pole, blue axle), scaled from its
    600x400 screen; no pygame needed.
    """
    lead = states.shape[:-1]
    s = states.reshape(-1, 4).float()
    unit = width / 600.0  # gymnasium draws on a 600-pixel-wide screen
    scale = width / (2 * CartPole.x_threshold)
    cart_w, cart_h, pole_w = 50 * unit, 30 * unit, 10 * unit
    pole_len = scale * 2 * CartPole.length
    track_y = height * 0.75
    ys = torch.arange(height, device=s.device, dtype=torch.float32).view(1, height, 1) + 0.5
    xs = torch.arange(width, device=s.device, dtype=torch.float32).view(1, 1, width) + 0.5
    cart_x = (s[:, 0] * scale + width / 2).view(-1, 1, 1)
    axle_y = track_y - cart_h / 4
    sin, cos = torch.sin(s[:, 2]).view(-1, 1, 1), torch.cos(s[:, 2]).view(-1, 1, 1)
    # distance of each pixel from the pole's axis segment, from the axle to the tip
    px, py = xs - cart_x, axle_y - ys  # pixel relative to the axle, y up
    along = (px * sin + py * cos).clamp(0.0, pole_len)
    pole = (px - along * sin).square() + (py - along * cos).square() <= (pole_w / 2) ** 2
    cart = ((xs - cart_x).abs() <= cart_w / 2) & (ys >= track_y - cart_h / 2) & (ys <= track_y + cart_h / 2)
    axle = px.square() + py.square() <= (pole_w / 2) ** 2
    track = (ys - track_y).abs() <= 0.5

    frame = torch.full((s.shape[0], height, width, 3), 255, dtype=torch.uint8, device=s.device)
    for mask, colour in ((track.expand_as(cart), (0, 0, 0)), (cart, (0, 0, 0)), (pole, (202, 152, 101)), (axle, (129, 132, 203))):
        frame[mask] = torch.tensor(colour, dtype=torch.uint8, device=s.device)
    return frame.view(*lead, height, width, 3)


def grid_video(obs: torch.Tensor) -> np.ndarray:
    """Frames (T, 4*h, 4*w, 3) uint8 of the first 16 envs of a rollout of CartPole observations (T, N, 4)."""
    frames = draw(obs[:, :16])  # (T, n, h, w, 3)
    t, n, h, w, _ = frames.shape
    if n < 16:  # fewer than 16 envs: blank tiles fill the grid
        frames = torch.cat((frames, frames.new_full((t, 16 - n, h, w, 3), 255)), dim=1)
    frames[:, :, [0, -1]] = 128  # thin grey border between tiles
    frames[:, :, :, [0, -1]] = 128
    frames = frames.view(t, 4, 4, h, w, 3).permute(0, 1, 3, 2, 4, 5).reshape(t, 4 * h, 4 * w, 3)
    return frames.cpu().numpy()


# ----------------------------------------------------------------------------------------------
# Networks
# ----------------------------------------------------------------------------------------------
def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """Orthogonal weights, constant bias (PPO implementation detail 2)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """A 64-64 tanh policy network; its head starts near uniform (std 0.01)."""

    def __init__(self, obs_dim: int, num_actions: int):
        super().__init__()
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, num_actions), std=0.01),
        )  # fmt: skip

    def get_action(self, obs: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        logits = self.actor(obs)
        if greedy:
            return logits.argmax(-1)
        # Gumbel-max: argmax(logits + Gumbel noise) samples the softmax distribution in 4 kernels
        return (logits - torch.empty_like(logits).exponential_().log()).argmax(-1)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor):
        """Log-probability of `action` and entropy."""
        logp = self.actor(obs).log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, action.unsqueeze(-1)).squeeze(-1), entropy


# ----------------------------------------------------------------------------------------------
# Algorithm
# ----------------------------------------------------------------------------------------------
def compute_returns(rewards: torch.Tensor, dones: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted reward-to-go over a (T, N) rollout: G_t = r_t + gamma * G_{t+1} * (1 - done_t).

    `dones[t]` ends an episode at step t, so no reward of the next episode leaks into G_t.
    """
    returns = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        running = rewards[t] + gamma * running * (~dones[t]).to(rewards.dtype)
        returns[t] = running
    return returns


def reinforce_loss(agent: Agent, args: Args, obs, actions, returns):
    """REINFORCE loss -mean(log pi(a|s) * G) over complete episodes; returns (loss, detached statistics)."""
    logprob, entropy = agent.evaluate(obs, actions)
    if args.normalize_returns:  # population std: a batch of one return normalises to 0, not NaN
        returns = (returns - returns.mean()) / (returns.std(correction=0) + 1e-8)
    pg_loss = -(logprob * returns).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss
    stats = torch.stack((pg_loss, entropy_loss, loss)).detach()
    return loss, stats


STAT_NAMES = ("losses/policy_loss", "losses/entropy", "losses/total_loss")


def evaluate_greedy(agent: Agent, env_cls, num_episodes: int, device: torch.device, seed: int) -> list[float]:
    """Return of the first episode of each of `num_episodes` envs under the greedy (argmax) policy."""
    envs = env_cls(num_episodes, device, seed)
    obs, _ = envs.reset()
    returns = torch.full((num_episodes,), float("nan"), device=device)
    with torch.no_grad():
        for _ in range(envs.max_episode_steps):
            obs, _, terminated, truncated, info = envs.step(agent.get_action(obs, greedy=True))
            first = (terminated | truncated) & returns.isnan()
            returns = torch.where(first, info["episode_return"], returns)
            if not returns.isnan().any():
                break
    return returns.tolist()


def validate(args: Args, envs=None) -> torch.device:
    """Reject bad flags with one clear line (raised as UsageError); return the torch device."""
    positive = ("num_envs", "num_steps", "total_timesteps", "video_interval")
    for name in positive:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.eval_episodes < 0 or args.torch_threads < 0:
        raise UsageError("--eval-episodes and --torch-threads must be >= 0")
    for name, ok, rule in (
        ("learning_rate", args.learning_rate > 0, "> 0"),
        ("gamma", 0 < args.gamma <= 1, "in (0, 1]"),
        ("ent_coef", args.ent_coef >= 0, ">= 0"),
        ("max_grad_norm", args.max_grad_norm > 0, "> 0"),
    ):
        if not (ok and math.isfinite(getattr(args, name) or 0.0)):
            raise UsageError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}")
    if envs is None and args.env_id not in ENVS:
        raise UsageError(f"unknown --env-id {args.env_id!r}; choose one of {', '.join(ENVS)}")
    env_cls = type(envs) if envs is not None else ENVS[args.env_id]
    if args.num_steps < env_cls.max_episode_steps:
        raise UsageError(
            f"--num-steps {args.num_steps} is below the episode limit {env_cls.max_episode_steps}: "
            "a rollout must be able to hold a whole episode"
        )
    if envs is not None and envs.num_envs != args.num_envs:
        raise UsageError(f"the env has {envs.num_envs} envs but --num-envs is {args.num_envs}")
    if args.capture_video and envs is not None and not isinstance(envs, CartPole):
        raise UsageError("--capture-video draws CartPole states; this env is not a CartPole")
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


def write_video(frames: np.ndarray, path: str, fps: int = 50) -> None:
    from moviepy import ImageSequenceClip

    ImageSequenceClip(list(frames), fps=fps).write_videofile(path, codec="libx264", audio=False, logger=None)


def train(args: Args, envs=None) -> Agent:
    """Train REINFORCE on `envs` (default: the `--env-id` env) and return the agent.

    Any env with the CartPole interface works, e.g. the probe envs of the tests.
    Writes TensorBoard events and summary.json to runs/<run>; re-raises KeyboardInterrupt after
    writing everything, and raises NonFiniteLossError when the loss stops being finite.
    """
    device = validate(args, envs)
    if device.type == "cpu":
        torch.set_num_threads(args.torch_threads or len(os.sched_getaffinity(0)))
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
    env_cls = type(envs) if envs is not None else ENVS[args.env_id]
    if envs is None:
        envs = env_cls(args.num_envs, device, args.seed)
    agent = Agent(envs.obs_dim, envs.num_actions).to(device)
    # the fused kernel is ~3x faster than the per-tensor loop on a small net
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)

    # rollout storage, preallocated on the device
    T, N = args.num_steps, args.num_envs
    obs_buf = torch.zeros((T, N, envs.obs_dim), device=device)
    actions_buf = torch.zeros((T, N), dtype=torch.long, device=device)
    rewards_buf = torch.zeros((T, N), device=device)
    dones_buf = torch.zeros((T, N), dtype=torch.bool, device=device)
    ep_return_buf = torch.zeros((T, N), device=device)
    ep_length_buf = torch.zeros((T, N), dtype=torch.int32, device=device)

    recent_returns: deque[float] = deque(maxlen=100)
    global_step, solved_step, solved_seconds, status = 0, None, None, "error"
    episodes = 0
    progress = None
    if args.progress_bar:
        from tqdm import tqdm

        progress = tqdm(total=args.total_timesteps, unit="step", unit_scale=True, dynamic_ncols=True)
    start_time = time.perf_counter()
    iteration = 0
    try:
        while global_step < args.total_timesteps:
            iteration += 1
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = (1.0 - global_step / args.total_timesteps) * args.learning_rate

            with torch.no_grad():
                obs, _ = envs.reset()  # fresh episodes: each one's return is complete within the rollout
                finished = torch.zeros(N, dtype=torch.bool, device=device)
                for t in range(T):
                    obs_buf[t] = obs
                    action = agent.get_action(obs)
                    obs, reward, terminated, truncated, info = envs.step(action)
                    actions_buf[t] = action
                    rewards_buf[t] = reward
                    dones_buf[t] = terminated | truncated
                    ep_return_buf[t] = info["episode_return"]
                    ep_length_buf[t] = info["episode_length"]
                    finished |= dones_buf[t]
                    # a host read every 10 steps, not every step: on a GPU each read waits for the device
                    if t % 10 == 9 and finished.all():
                        break
                steps = t + 1
                global_step += steps * N

                returns = compute_returns(rewards_buf[:steps], dones_buf[:steps], args.gamma)
                # a step has a complete return if its env finishes an episode at or after it
                complete = dones_buf[:steps].flip(0).cumsum(0).flip(0) > 0
            loss, stats = reinforce_loss(
                agent, args, obs_buf[:steps][complete], actions_buf[:steps][complete], returns[complete]
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()

            # the host reads of the iteration, for logging: losses and the finished episodes
            stats = stats.tolist()
            if not all(math.isfinite(v) for v in stats):
                status = "non-finite loss"
                raise NonFiniteLossError(f"non-finite loss at iteration {iteration} (env step {global_step})")
            episodes_done = torch.stack((ep_return_buf[:steps], ep_length_buf[:steps].float()), dim=-1)[dones_buf[:steps]]
            done_returns = [r for r, _ in episodes_done.tolist()]
            done_lengths = [l for _, l in episodes_done.tolist()]
            recent_returns.extend(done_returns)
            episodes += len(done_returns)
            elapsed = time.perf_counter() - start_time
            sps = int(global_step / elapsed)
            mean_recent = float(np.mean(recent_returns)) if recent_returns else float("nan")
            if solved_step is None and len(recent_returns) == 100 and mean_recent >= SOLVED_RETURN:
                solved_step, solved_seconds = global_step, elapsed

            if done_returns:
                writer.add_scalar("charts/episodic_return", float(np.mean(done_returns)), global_step)
                writer.add_scalar("charts/episodic_length", float(np.mean(done_lengths)), global_step)
            writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
            writer.add_scalar("charts/SPS", sps, global_step)
            for name, value in zip(STAT_NAMES, stats):
                writer.add_scalar(name, value, global_step)
            if progress is not None:
                progress.update(steps * N)
                progress.set_postfix(SPS=sps, ret=f"{mean_recent:.1f}", refresh=False)

            if args.capture_video and (iteration - 1) % args.video_interval == 0:
                os.makedirs(os.path.join(run_dir, "videos"), exist_ok=True)
                video_path = os.path.join(run_dir, "videos", f"rollout_iter{iteration:05d}.mp4")
                write_video(grid_video(obs_buf[:steps]), video_path)
                if args.track:
                    wandb.log({"videos/rollout": wandb.Video(video_path, format="mp4")})

            if args.target_return is not None and len(recent_returns) == 100 and mean_recent >= args.target_return:
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
            "status": status,
            "total_env_steps": global_step,
            "wall_seconds": round(elapsed, 3),
            "mean_sps": round(global_step / elapsed, 1) if elapsed > 0 else 0.0,
            "episodes": episodes,
            "mean_return_last_100": float(np.mean(recent_returns)) if recent_returns else None,
            "solved_threshold": SOLVED_RETURN,
            "solved_at_step": solved_step,
            "solved_at_seconds": None if solved_seconds is None else round(solved_seconds, 3),
        }
        if status != "non-finite loss":  # NaN weights are not worth saving
            if args.save_model:
                model_path = os.path.join(run_dir, f"{args.exp_name}.cleanrl_model")
                torch.save(agent.state_dict(), model_path)
                summary["model_path"] = model_path
            if args.eval_episodes and status in ("completed", "target return reached"):
                eval_returns = evaluate_greedy(agent, env_cls, args.eval_episodes, device, args.seed + 1)
                summary["eval_returns"] = eval_returns
                summary["eval_mean_return"] = float(np.mean(eval_returns))
                writer.add_scalar("eval/episodic_return", summary["eval_mean_return"], global_step)
        summary["args"] = asdict(args)
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        solved = "never" if solved_step is None else f"at step {solved_step:,} ({solved_seconds:.2f} s)"
        print(
            f"{status}: {global_step:,} steps in {elapsed:.1f} s ({summary['mean_sps']:,.0f} SPS); "
            f"mean return of the last 100 episodes {summary['mean_return_last_100']}, reached {SOLVED_RETURN:g} {solved}; "
            f"greedy evaluation {summary.get('eval_mean_return', 'skipped')}; outputs in {run_dir}"
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
