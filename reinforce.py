"""REINFORCE (Williams 1992) with reward-to-go returns on the tensor CartPole.

The first rung of the ladder (reinforce.py -> vpg.py -> ppo_cartpole_gpu.py): a policy network alone, pushed towards
the actions that were followed by high returns. The environment, rollout and update all live on one device
(`--device cuda` when a GPU is there, else the CPU).

Run:
    python reinforce.py                             # defaults: solves CartPole on a laptop CPU
    python reinforce.py --no-normalize-returns      # raw returns: watch the variance
    tensorboard --logdir runs

The update, one gradient step per rollout:
    G_t  = r_t + γ G_{t+1} (1 - done_t)             the discounted reward-to-go of step t
    L    = -E[ log π_θ(a_t|s_t) Ĝ_t ] - c_ent H[π_θ]
where Ĝ is G normalised to zero mean and unit std over the batch (`--normalize-returns`), a crude baseline that
vpg.py replaces with a learned one.

A return needs the rest of its episode. Every rollout therefore starts with a reset of all envs and runs until each env
has finished an episode (or `--num-steps` steps, which by default is the 500-step limit, so that always happens). The
batch is each env's first episode of the rollout: an unbiased sample of the policy's episodes. (Also keeping the later
episodes that happen to end before the slowest env's first one would favour short episodes.) There is no critic to
bootstrap with, so an episode cut at 500 steps counts with the return it has. Comments marked "detail N" refer to
Huang et al. 2022's PPO implementation details, as in ppo_cartpole_gpu.py.
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
from ladder.compile import compiled
from ladder.cuda_graph import CudaGraph
from ladder.distributed import mean_over_ranks
from ladder.flags import RunFlags, UsageError, check_flags
from ladder.optim import Adam
from ladder.run import Run

THREADED_FROM_ENVS = 1024  # one torch thread below this many envs (docs/running.md: "Threads and a busy machine")


@dataclass(frozen=True)  # the run's flags, fixed: what changes in training is a tensor (docs/modifying.md)
class Args(RunFlags):
    # The algorithm's flags: a --resume keeps these as the checkpoint has them
    env_id: Literal["CartPole-v1", "EasyCart-v1", "SpinCart-v1"] = "CartPole-v1"
    """the environment: CartPole-v1, EasyCart-v1 (shaped reward) or SpinCart-v1 (spin the pole)"""
    seed: int = 1
    """seed of the networks, the action sampling and the environments"""
    learning_rate: float = 5e-3
    """Adam learning rate"""
    num_envs: int = 128
    """parallel environments (per process under torchrun)"""
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

    # The run's flags (`RunFlags`: --total-timesteps, --device, --track, --resume, ...): the defaults that differ here
    target_return: Optional[float] = 500.0
    """stop once the mean return of the last 100 episodes reaches this (None: never; the shaped envs never reach 500)"""
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    checkpoint_interval: int = 50
    """iterations between checkpoints to <run folder>/checkpoint.pt (0: only at the end, on Ctrl-C or SIGTERM)"""

    def __post_init__(self):
        """The algorithm's flags checked, for the command line and `Args(...)` in code alike (the run's: ladder)."""
        positive = ("num_envs", "num_steps", "total_timesteps", "num_seeds")
        rules = {name: (getattr(self, name) > 0, "positive") for name in positive}
        rules |= {
            "learning_rate": (self.learning_rate > 0, "> 0"),
            "gamma": (0 < self.gamma <= 1, "in (0, 1]"),
            "ent_coef": (self.ent_coef >= 0, ">= 0"),
            "max_grad_norm": (self.max_grad_norm > 0, "> 0"),
        }
        check_flags(self, rules)


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
        """Log-probability of `action` and entropy."""
        logp = self.actor(obs).log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, action.unsqueeze(-1)).squeeze(-1), entropy


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
        shapes = dict(obs=(obs_dim,), final_obs=(obs_dim,))  # the others (T, N)
        dtypes = dict(actions=torch.long, terminated=torch.bool, dones=torch.bool, episode_length=torch.int32)
        return Rollout(*(zeros(*shapes.get(f, ()), dtype=dtypes.get(f, torch.float32)) for f in Rollout._fields))


class RolloutNoise(NamedTuple):
    """A rollout's random numbers, drawn before it: `collect_rollout` is then pure tensor code, one compiled graph."""

    gumbel: torch.Tensor  # (T, N, num_actions) Gumbel noise, -log(Exp(1)), for sampling the actions
    initial_states: torch.Tensor  # (T, N, obs_dim) where an env restarts if its episode ends at step t

    @staticmethod
    def draw(envs, num_steps: int) -> RolloutNoise:
        """The Gumbel noise -log(-log U) from torch's global generator (seeded by --seed), the states from the env's."""
        uniform = torch.rand(num_steps, envs.num_envs, envs.num_actions, device=envs.device)
        return RolloutNoise(-(-uniform.log()).log(), envs.draw_initial_states(num_steps, envs.num_envs))


class Batch(NamedTuple):
    """A rollout's T*N transitions with what the loss needs; `first` marks those of each env's first episode, the
    ones the loss takes (a mask keeps the batch one shape: compiled or vmapped over seeds, whatever the episodes)."""

    obs: torch.Tensor
    actions: torch.Tensor
    returns: torch.Tensor  # G_t
    first: torch.Tensor  # 1.0 for a step of its env's first episode, else 0.0


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


def collect_episodes(collect, run, agent: Agent, envs, storage: Rollout) -> int:
    """Reset every env, then step them all in chunks of 10 steps (`collect`: `collect_rollout`, compiled with --compile)
    until each env has finished an episode (at most T steps), filling the first rows of `storage`; return the number of
    steps taken. (`terminated` and `final_obs` go unused, filled to keep `collect_rollout` as in the other two.)
    --num-seeds K: `storage` is [K, T, ...], the chunks go on until every seed's envs have finished an episode."""
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
    """Discounted reward-to-go over a (T, N) rollout: G_t = r_t + gamma * G_{t+1} * (1 - done_t). `dones[t]` ends an
    episode at step t, so no reward of the next episode leaks into G_t."""
    returns = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        running = rewards[t] + gamma * running * (~dones[t]).to(rewards.dtype)
        returns[t] = running
    return returns


def first_episodes(dones: torch.Tensor) -> torch.Tensor:
    """(T, N) mask of the steps of each env's first episode in a rollout that starts with a reset, its last step
    included: the steps no episode end precedes. An env that finished no episode (possible only with `num-steps` below
    a custom env's episode limit) has no complete return: none of its steps are in it."""
    return (dones.cumsum(0) - dones.int() == 0) & dones.any(0)


def reinforce_loss(agent: Agent, args: Args, batch: Batch):
    """REINFORCE loss -mean(log pi(a|s) * G) over complete episodes (the steps `batch.first` marks); returns (loss,
    stats keyed by TensorBoard tag)."""
    logprob, entropy = agent(batch.obs, batch.actions)
    mean_of = lambda x: (batch.first * x).sum() / batch.first.sum()  # over the first episodes' steps
    returns = batch.returns
    if args.normalize_returns:  # population std: a batch of one return normalises to 0, not NaN
        returns = (returns - mean_of(returns)) / (mean_of((returns - mean_of(returns)).square()).sqrt() + 1e-8)
    pg_loss = -mean_of(logprob * returns)
    entropy_loss = mean_of(entropy)
    loss = pg_loss - args.ent_coef * entropy_loss
    stats = {"losses/policy_loss": pg_loss, "losses/entropy": entropy_loss, "losses/total_loss": loss}
    return loss, {tag: value.detach() for tag, value in stats.items()}


def gradient_step(agent: nn.Module, optimizer: Adam, loss_fn, args, batch, idx=None) -> dict:
    """One Adam step on `loss_fn(agent, args, minibatch)`, the minibatch being the rows `idx` of `batch` (all of it
    when None): the gradient in the agent's parameters, held as one vector (ladder/optim.py), the ranks' mean under
    torchrun, its norm clipped to `max-grad-norm` (detail 11). It runs as written eager, compiled, vmapped over
    stacked seeds and in a CUDA graph; returns the loss statistics."""
    minibatch = batch if idx is None else type(batch)(*(x[idx] for x in batch))
    grad, stats = optimizer.gradient(loss_fn, agent, args, minibatch)
    grad = mean_over_ranks(grad)  # data parallel under torchrun
    optimizer.step(grad * (args.max_grad_norm / (grad.norm() + 1e-6)).clamp(max=1.0))
    return stats


def train(args: Args, envs=None) -> Agent:
    """Train REINFORCE on `envs` (default: the `--env-id` env) and return the agent. Any env with the CartPole
    interface works, e.g. the tests' probe envs. `Run` writes the outputs, also when an exception ends the run."""
    device, given_envs = torch.device(args.device), envs
    if args.compile and args.num_seeds > 1:  # the stacked update, compiled whole, would compile again at each length
        raise UsageError("--compile does not go with --num-seeds here: the update's length changes every iteration")
    with Run(args, evaluate, record_video) as run:  # the run folder and all in it: ladder/run.py
        for seed in run.seeds():  # the set-up, once per seed (--num-seeds K: K times, then the loop once for all K)
            torch.manual_seed(seed + run.rank)  # under torchrun each rank samples its own actions
            envs = make_envs(args, device, given_envs, seed + run.rank)
            if args.num_steps < envs.max_episode_steps:  # a rollout must hold a whole episode
                raise UsageError(f"--num-steps {args.num_steps} is below the episode limit {envs.max_episode_steps}")
            agent = Agent(envs.obs_dim, envs.num_actions).to(device)  # `run.start` gives every rank rank 0's weights
            optimizer = Adam(agent, lr=args.learning_rate, eps=1e-5)
            initial_lrs = [float(group["lr"]) for group in optimizer.param_groups]  # each group anneals from its own
            total_steps = 0 if args.eval_only else args.total_timesteps  # --eval-only: Run evaluates at the end
            # with --resume: agent, optimizer, envs, RNGs and counters as the checkpoint left them; state you add goes
            # in by name, e.g. run.start(..., kl_coef=kl_coef): a tensor (changed in place) or an object with a
            # state_dict(). The last seed's: the K seeds' state stacked [K, ...] in its objects, which go on below
            run.start(agent, envs, optimizer, total_steps)
        storage = run.each(
            Rollout.empty, args.num_steps, args.num_envs, envs.obs_dim, device
        )  # --num-seeds K: [K, ...]
        phases = (collect_rollout, gradient_step)  # --compile: each one graph (ladder/compile.py)
        collect, step = map(compiled, phases) if args.compile else phases

        def learn(rollout: Rollout):  # the update on each env's first episode in `rollout`, one gradient step
            first = first_episodes(rollout.dones)  # an unbiased sample of the policy's episodes (the docstring)
            returns = compute_returns(rollout.rewards, rollout.dones, args.gamma)
            obs, actions = rollout.obs.flatten(0, 1), rollout.actions.flatten()
            batch = Batch(obs, actions, returns.flatten(), first.flatten().float())
            for x in batch if args.compile else ():  # one graph of the step for every number of steps, from the first
                torch._dynamo.maybe_mark_dynamic(x, 0)
            stats = step(agent, optimizer, reinforce_loss, args, batch)
            return stats, finished_episodes(rollout._replace(dones=rollout.dones & first))  # logged: those trained on

        if args.num_seeds > 1:  # --num-seeds K: one call for all K seeds, vmapped over their stacked state
            collect, learn = run.stacked(collect), run.stacked(learn)
        elif run.device.type in CudaGraph.devices:  # on a GPU: each 10-step chunk recorded once as a CUDA graph
            collect = CudaGraph(collect, run)
        for _ in run.iterations():  # from the checkpoint's on; a checkpoint or a signal's stop between two
            for group, lr in zip(optimizer.param_groups, initial_lrs) if args.anneal_lr else ():
                group["lr"].fill_((1 - run.progress.global_step / total_steps) * lr)  # in place: see ladder/optim.py
            steps = collect_episodes(collect, run, agent, envs, storage)
            time = storage.dones.dim() - 2  # the steps' dimension: 0, or 1 after --num-seeds K's seeds
            rollout = Rollout(*(x.narrow(time, 0, steps) for x in storage))
            for x in rollout if args.compile else ():  # one graph for every number of steps
                torch._dynamo.maybe_mark_dynamic(x, time)
            stats, episodes = learn(rollout)
            if run.log(steps * args.num_envs, stats, episodes, storage):  # True once the target return is reached
                break
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


def make_envs(args: Args, device: torch.device, envs=None, seed: int = 0):
    """The `--env-id` envs seeded `seed`, or the given `envs` (e.g. a probe) checked against the flags."""
    if envs is not None and args.num_seeds > 1:
        raise UsageError("--num-seeds builds each seed's envs: give train() none")
    if envs is None:
        env_class = {"CartPole-v1": CartPole, "EasyCart-v1": EasyCart, "SpinCart-v1": SpinCart}[args.env_id]
        envs = env_class(args.num_envs, device, seed)
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
    for mask, colour in (
        (track.expand_as(cart), (0, 0, 0)),
        (cart, (0, 0, 0)),
        (pole, (202, 152, 101)),
        (axle, (129, 132, 203)),
    ):
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
    import imageio.v2 as imageio  # (only a run that films imports it)

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with imageio.get_writer(path, fps=fps, macro_block_size=2) as writer:  # odd sides padded to even (H.264)
        for frame in frames.cpu().numpy():
            writer.append_data(frame)
    return path


def main() -> None:
    """`python reinforce.py [flags]`: the flags parsed and checked, then `train` (ladder/cli.py)."""
    run_command_line(Args, train, THREADED_FROM_ENVS)


if __name__ == "__main__":
    main()
