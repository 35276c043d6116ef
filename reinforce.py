"""REINFORCE (Williams 1992) with reward-to-go returns on the tensor CartPole, all on `--device`: the first rung of the
ladder (reinforce.py -> vpg.py -> ppo_cartpole_gpu.py), a policy network alone ("detail N": Huang et al. 2022).

The update, one gradient step per rollout:
    G_t  = r_t + γ G_{t+1} (1 - done_t)             the discounted reward-to-go of step t
    L    = -E[ log π_θ(a_t|s_t) Ĝ_t ] - c_ent H[π_θ]
where Ĝ is G normalised over the batch (`--normalize-returns`), a crude baseline that vpg.py learns instead.

A return needs the rest of its episode: each rollout starts with a reset and runs until every env has finished an
episode (at most `--num-steps`); the batch is each env's first one, an unbiased sample (later ones that end early would
favour short episodes). With no critic to bootstrap, an episode cut at 500 steps counts with its return so far.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

# OpenMP threads that sleep, not spin, while they wait (4x faster on a busy 2-core machine): set before torch loads it
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn as nn

from ladder.cli import run_command_line
from ladder.distributed import average_gradients
from ladder.flags import RunFlags, UsageError
from ladder.optim import Adam
from ladder.run import Run

THREADED_FROM_ENVS = 1024  # one torch thread below this many envs (docs/running.md: "Threads and a busy machine")


@dataclass(frozen=True)
class Args(RunFlags):
    # The algorithm's flags: a --resume keeps these as the checkpoint has them; after them, run flags' defaults
    env_id: Literal["CartPole-v1", "EasyCart-v1", "SpinCart-v1"] = "CartPole-v1"
    """the environment: CartPole-v1, EasyCart-v1 (shaped reward) or SpinCart-v1 (spin the pole)"""
    seed: int = 1
    """seed of the networks, the action sampling and the environments"""
    learning_rate: float = 5e-3
    """Adam learning rate"""
    num_envs: int = 128
    """parallel environments (per process under torchrun)"""
    num_steps: int = 500
    """steps per env per rollout at most, at least the episode limit (it ends once each env finished an episode)"""
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

    target_return: Optional[float] = 500.0
    """stop once the mean return of the last 100 episodes reaches this (None: never; the shaped envs never reach 500)"""
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    checkpoint_interval: int = 50
    """iterations between checkpoints to <run folder>/checkpoint.pt (0: only at the end, on Ctrl-C or SIGTERM)"""

    def __post_init__(self):
        positive = ("num_envs", "num_steps", "total_timesteps", "num_seeds")
        rules = {name: (getattr(self, name) > 0, "positive") for name in positive}
        rules |= {
            "learning_rate": (self.learning_rate > 0, "> 0"),
            "gamma": (0 < self.gamma <= 1, "in (0, 1]"),
            "ent_coef": (self.ent_coef >= 0, ">= 0"),
            "max_grad_norm": (self.max_grad_norm > 0, "> 0"),
            "compile": (
                not self.compile or self.num_seeds == 1 and not self.sweep,
                "off with --num-seeds or --sweep here (the stacked update would compile again at each length)",
            ),
            "capture_video": (
                not self.capture_video or issubclass(ENVS[self.env_id], CartPole) and ENVS[self.env_id].obs_dim == 4,
                f"off for {self.env_id}: it draws CartPole states",
            ),
        }
        for name, (ok, rule) in rules.items():  # a ValueError here: one `error:` line (tyro's, shortened)
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(self, name)}")


# Environment ----------------------------------------------------------------------------------
class CartPole:
    """Gymnasium's CartPole-v1 for `num_envs` envs in float32 torch ops; its public attributes and methods are what
    `train` asks of any env (docs/modifying.md#the-environment)."""

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
        return (torch.rand(*lead, 4, n, device=self.device, generator=self.generator) * 0.1 - 0.05).mT

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
        # explicit Euler as gymnasium; the state kept feature-major ((4, N) seen as (N, 4)): ~9x cheaper stacking
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
        """What a checkpoint needs to go on exactly, on the CPU (NCCL would rebuild rank r's CUDA tensors on cuda:r)."""
        generator = self.generator.get_state()  # and a seed drawn from it, then undrawn: for the other kind of device
        seed = torch.randint(2**62, (), device=self.device, generator=self.generator)
        self.generator.set_state(generator)
        saved = {"state": self.state, "episode_return": self.episode_return, "episode_length": self.episode_length}
        return {k: v.cpu() for k, v in saved.items()} | {"generator": generator, "seed": seed.cpu()}

    def load_state_dict(self, saved: dict) -> torch.Tensor:
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
    """nn.Tanh; under torch.compile 2σ(2x) - 1 (equal within 2e-7): inductor's tanh costs ~2x as much on a CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * torch.sigmoid(2 * x) - 1 if torch.compiler.is_compiling() else torch.tanh(x)


def mlp(in_dim: int, out_dim: int, out_std: float) -> nn.Sequential:
    hidden = [layer_init(nn.Linear(in_dim, 64)), Tanh(), layer_init(nn.Linear(64, 64)), Tanh()]
    return nn.Sequential(*hidden, layer_init(nn.Linear(64, out_dim), std=out_std))


class Agent(nn.Module):
    """A 64-64 tanh policy network; its head starts near uniform (std 0.01)."""

    def __init__(self, obs_dim: int, num_actions: int):
        super().__init__()
        self.actor = mlp(obs_dim, num_actions, out_std=0.01)

    def get_action(self, obs: torch.Tensor, gumbel: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Gumbel-max: argmax(logits + `gumbel` noise) samples the softmax in a few kernels; without noise: greedy."""
        logits = self.actor(obs)
        return logits.argmax(-1) if gumbel is None else (logits + gumbel).argmax(-1)

    def forward(self, obs: torch.Tensor, action: torch.Tensor):
        logp = self.actor(obs).log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, action.unsqueeze(-1)).squeeze(-1), entropy


# Algorithm ------------------------------------------------------------------------------------
class Rollout(NamedTuple):
    """T steps of N envs, (T, N) or (T, N, obs_dim) each, on the device (detail 1): `final_obs` is s'_t before any
    auto-reset; `terminated`: no future to bootstrap; `dones`: an episode ended, its return in `episode_return`."""

    obs: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    terminated: torch.Tensor
    dones: torch.Tensor
    final_obs: torch.Tensor
    episode_return: torch.Tensor
    episode_length: torch.Tensor

    @staticmethod
    def empty(num_steps: int, num_envs: int, obs_dim: int, device: torch.device) -> Rollout:
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(num_steps, num_envs, *shape, dtype=dtype, device=device)
        shapes = dict(obs=(obs_dim,), final_obs=(obs_dim,))
        dtypes = dict(actions=torch.long, terminated=torch.bool, dones=torch.bool, episode_length=torch.int32)
        return Rollout(*(zeros(*shapes.get(f, ()), dtype=dtypes.get(f, torch.float32)) for f in Rollout._fields))


class RolloutNoise(NamedTuple):
    """A rollout's random numbers, drawn before it so that `collect_rollout` is pure tensor code: Gumbel noise
    (T, N, num_actions) to sample the actions, and (T, N, *state) the state an env restarts in when its episode ends."""

    gumbel: torch.Tensor
    initial_states: torch.Tensor

    @staticmethod
    def draw(envs, num_steps: int) -> RolloutNoise:
        """The Gumbel noise -log(-log U) from torch's global generator (seeded by --seed), the states from the env's."""
        uniform = torch.rand(num_steps, envs.num_envs, envs.num_actions, device=envs.device)
        return RolloutNoise(-(-uniform.log()).log(), envs.draw_initial_states(num_steps, envs.num_envs))


class Batch(NamedTuple):
    """A rollout's T*N steps; `first` (1.0 or 0.0) marks each env's first episode, the loss's: one shape, compiled."""

    obs: torch.Tensor
    actions: torch.Tensor
    returns: torch.Tensor  # G_t
    first: torch.Tensor


def collect_rollout(agent: Agent, envs, obs: torch.Tensor, rollout: Rollout, noise: RolloutNoise) -> torch.Tensor:
    with torch.no_grad():
        for t in range(len(rollout.obs)):
            rollout.obs[t] = obs
            action = agent.get_action(obs, noise.gumbel[t])
            obs, reward, terminated, truncated, info = envs.step(action, noise.initial_states[t])
            rollout.actions[t], rollout.rewards[t], rollout.terminated[t] = action, reward, terminated
            rollout.dones[t], rollout.final_obs[t] = terminated | truncated, info["final_obs"]
            rollout.episode_return[t], rollout.episode_length[t] = info["episode_return"], info["episode_length"]
    return obs


def collect_episodes(collect, run, agent: Agent, envs, storage: Rollout) -> int:
    """Reset every env, then step them all in chunks of 10 steps (`collect`) until each env (of every seed) has finished
    an episode, at most T steps, filling the first rows of `storage`; return the number of steps taken."""
    time = storage.dones.dim() - 2  # the steps' dimension: 0, or 1 after --num-seeds K's seeds
    obs = run.each(fresh_episodes, envs)  # each env's first episode is then complete within the rollout
    for start in range(0, storage.dones.shape[time], 10):
        chunk = Rollout(*(x.narrow(time, start, min(10, x.shape[time] - start)) for x in storage))
        obs = collect(agent, envs, obs, chunk, run.each(RolloutNoise.draw, envs, chunk.dones.shape[time]))
        # a host read every 10 steps, not every step: on a GPU each read waits for the device
        if storage.dones.narrow(time, 0, start + chunk.dones.shape[time]).any(time).all():
            break
    return start + chunk.dones.shape[time]


def fresh_episodes(envs) -> torch.Tensor:
    return envs.reset()[0]


def compute_returns(rewards: torch.Tensor, dones: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} * (1 - done_t) over (T, N): no reward of the next episode leaks into G_t."""
    returns = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        running = rewards[t] + gamma * running * (~dones[t]).to(rewards.dtype)
        returns[t] = running
    return returns


def first_episodes(dones: torch.Tensor) -> torch.Tensor:
    """(T, N) mask of each env's first episode in a rollout that starts with a reset (none where none ended)."""
    return (dones.cumsum(0) - dones.int() == 0) & dones.any(0)


def reinforce_loss(agent: Agent, args: Args, batch: Batch):
    """-mean(log pi(a|s) * G) over complete episodes (the steps `batch.first` marks); returns (loss, stats)."""
    logprob, entropy = agent(batch.obs, batch.actions)
    mean_of = lambda x: (batch.first * x).sum() / batch.first.sum()
    returns = batch.returns
    if args.normalize_returns:  # population std: a batch of one return normalises to 0, not NaN
        returns = (returns - mean_of(returns)) / (mean_of((returns - mean_of(returns)).square()).sqrt() + 1e-8)
    pg_loss = -mean_of(logprob * returns)
    entropy_loss = mean_of(entropy)
    loss = pg_loss - args.ent_coef * entropy_loss
    stats = {"losses/policy_loss": pg_loss, "losses/entropy": entropy_loss, "losses/total_loss": loss}
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


def train(args: Args, envs=None) -> Agent:
    """Train REINFORCE on `envs` (default: the `--env-id` env; any with the CartPole's interface, e.g. a probe)."""
    device, given_envs = torch.device(args.device), envs
    rank = int(os.environ.get("RANK", "0"))
    with Run(args, evaluate, record_video) as run:
        for args in run.args_per_run:  # set up each run; then the last one's objects hold all K (--num-seeds, --sweep)
            torch.manual_seed(args.seed + rank)  # under torchrun each rank samples its own actions
            envs = make_envs(args, device, given_envs, args.seed + rank)
            if args.num_steps < (limit := envs.max_episode_steps):  # a rollout must hold a whole episode
                raise UsageError(f"--num-steps must be at least the episode limit {limit}, got {args.num_steps}")
            agent = Agent(envs.obs_dim, envs.num_actions).to(device)
            optimizer = Adam(agent, lr=args.learning_rate, eps=1e-5)
            for group in optimizer.param_groups:  # --anneal-lr's start: each group's (each --sweep run's) rate
                group["first_lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64, device=device)
            total_steps = 0 if args.eval_only else args.total_timesteps
            # --resume: all as the checkpoint left it; state of your own goes in by name (docs/modifying.md)
            run.start(agent, envs, optimizer, total_steps)
        storage = run.each(Rollout.empty, args.num_steps, args.num_envs, envs.obs_dim, device)
        phases = (collect_rollout, gradient_step)
        collect, step = [torch.compile(f, fullgraph=True) for f in phases] if args.compile else phases

        def learn(rollout: Rollout):
            first = first_episodes(rollout.dones)
            returns = compute_returns(rollout.rewards, rollout.dones, args.gamma)
            obs, actions = rollout.obs.flatten(0, 1), rollout.actions.flatten()
            batch = Batch(obs, actions, returns.flatten(), first.flatten().float())
            for x in batch if args.compile else ():  # one graph of the step for every number of steps, from the first
                torch._dynamo.maybe_mark_dynamic(x, 0)
            stats = step(agent, optimizer, reinforce_loss, args, batch)
            return stats, finished_episodes(rollout._replace(dones=rollout.dones & first))  # logged: those trained on

        # one call for all K runs (--num-seeds, --sweep), vmapped over their state; on a GPU one CUDA graph per
        # 10-step chunk, replayed (one run's `learn` runs as written: its length changes with the episodes)
        collect = run.one_call(collect)
        learn = run.one_call(learn) if len(run.args_per_run) > 1 else learn
        for _ in run.iterations():
            for group in optimizer.param_groups if args.anneal_lr else ():  # in place: see ladder/optim.py
                group["lr"].copy_((1 - run.progress.global_step / total_steps) * group["first_lr"])
            steps = collect_episodes(collect, run, agent, envs, storage)
            time = storage.dones.dim() - 2
            rollout = Rollout(*(x.narrow(time, 0, steps) for x in storage))
            for x in rollout if args.compile else ():  # one graph for every number of steps
                torch._dynamo.maybe_mark_dynamic(x, time)
            stats, episodes = learn(rollout)
            run.log(steps * args.num_envs, stats, episodes)
            run.film(storage)
            if run.target_reached():
                break
            run.checkpoint()  # every --checkpoint-interval iterations; last in the loop, so all its state is in it
    return agent


# What train() and the run call: env variants, episodes, evaluation, videos
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


ENVS = {"CartPole-v1": CartPole, "EasyCart-v1": EasyCart, "SpinCart-v1": SpinCart}  # --env-id's


def make_envs(args: Args, device: torch.device, envs=None, seed: int = 0):
    """The `--env-id` envs seeded `seed`, or the given `envs` (e.g. a probe) checked against the flags."""
    if envs is not None and args.num_seeds > 1:
        raise ValueError("--num-seeds builds each seed's envs: give train() none")
    if envs is None:
        envs = ENVS[args.env_id](args.num_envs, device, seed)
    if envs.num_envs != args.num_envs:
        raise ValueError(f"the env has {envs.num_envs} envs but --num-envs is {args.num_envs}")
    if args.capture_video and not (isinstance(envs, CartPole) and envs.obs_dim == 4):  # `draw`: the whole state
        raise ValueError(f"--capture-video draws CartPole states; {type(envs).__name__}'s observations are not")
    return envs


def finished_episodes(rollout: Rollout):
    """(ended, return, length), tensors of one shape: the episodes that ended during `rollout`."""
    return rollout.dones, rollout.episode_return, rollout.episode_length


def evaluate(agent: Agent, envs, args: Args, video: Optional[str], num_envs: Optional[int] = None) -> list[float]:
    """One whole episode's return in each of `eval-episodes` (or `num_envs`) fresh envs, greedy; `video`: filmed."""
    envs = type(envs)(num_envs or args.eval_episodes, envs.device, args.seed + 1)
    obs, _ = envs.reset()
    returns, frames = torch.full((envs.num_envs,), float("nan"), device=envs.device), []
    with torch.no_grad():
        for _ in range(envs.max_episode_steps):
            playing = returns[:16].isnan().unsqueeze(1)
            frames.append(torch.where(playing, obs[:16], frames[-1]) if frames else obs[:16])
            obs, _, terminated, truncated, info = envs.step(agent.get_action(obs))
            returns = torch.where((terminated | truncated) & returns.isnan(), info["episode_return"], returns)
            if not returns.isnan().any():
                break
    if video is not None:
        grid_video(video, torch.stack(frames), fps=round(1 / envs.tau))
    return returns.tolist()


def record_video(agent: Agent, envs, rollout: Rollout, args: Args, path: str) -> str:
    """Whole greedy episodes of the policy as it is now, in the same 16 new envs at every video (training's go on)."""
    evaluate(agent, envs, args, path, num_envs=16)
    return path


def draw(states: torch.Tensor, width: int = 150, height: int = 100) -> torch.Tensor:
    """CartPole states (..., 4) as RGB frames (..., height, width, 3) uint8: gymnasium's picture, without pygame."""
    s = states.reshape(-1, 4, 1, 1).float()
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
    for mask, colour in (
        (track.expand_as(cart), (0, 0, 0)),
        (cart, (0, 0, 0)),
        (pole, (202, 152, 101)),
        (axle, (129, 132, 203)),
    ):
        frame[mask] = torch.tensor(colour, dtype=torch.uint8, device=s.device)
    return frame.view(*states.shape[:-1], height, width, 3)


def grid_video(path: str, obs: torch.Tensor, fps: int) -> str:
    """An MP4 at `path` of up to 16 envs' observations (T, N, 4), tiled as squarely as they fit (10 envs: 3x4)."""
    frames = draw(obs[:, :16])
    t, n, h, w, _ = frames.shape
    rows, cols = math.isqrt(n), -(-n // math.isqrt(n))
    if n < rows * cols:  # blank tiles fill the last row
        frames = torch.cat((frames, frames.new_full((t, rows * cols - n, h, w, 3), 255)), dim=1)
    frames[:, :, [0, -1]] = 128  # thin grey border between tiles
    frames[:, :, :, [0, -1]] = 128
    frames = frames.view(t, rows, cols, h, w, 3).permute(0, 1, 3, 2, 4, 5).reshape(t, rows * h, cols * w, 3)
    import imageio.v2 as imageio  # (only a run that films imports it)

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with imageio.get_writer(path, fps=fps, macro_block_size=2) as writer:  # odd sides padded to even (H.264)
        for frame in frames.cpu().numpy():
            writer.append_data(frame)
    return path


def main() -> None:
    run_command_line(Args, train, THREADED_FROM_ENVS)


if __name__ == "__main__":
    main()
