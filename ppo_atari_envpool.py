"""PPO on Atari through EnvPool 1.x (C++ emulators), with the Nature CNN: CleanRL's ppo_atari_envpool.py for today's
stack (gymnasium's API, numpy 2, torch, tyro); the emulators run in EnvPool's threads, the networks on `--device`.

The env is EnvPool's Atari preprocessing (Mnih et al. 2015; docs/ppo_atari_envpool.md), training on lives and clipped
rewards; the scores logged are the real game scores (`GameStats`). EnvPool resets an env on the step *after* done: that
step is stored but masked out of the loss. The observation returned with done is the real last frame, so a game cut by
the step limit is bootstrapped from its value.

The update (Schulman et al. 2017; "detail N": Huang et al. 2022, "The 37 Implementation Details of PPO"):
    ρ_t(θ)  = π_θ(a_t|s_t) / π_θold(a_t|s_t)
    δ_t     = r_t + γ (1 - term_t) V(s_{t+1}) - V(s_t)
    Â_t     = δ_t + γλ (1 - done_t) Â_{t+1}
    L_clip  = E[ max(-Â_t ρ_t(θ), -Â_t clip(ρ_t(θ), 1-ε, 1+ε)) ]
    L_V     = ½ E[ max((V_θ(s_t) - R_t)², (V_old + clip(V_θ - V_old, -ε, ε) - R_t)²) ],  R_t = Â_t + V_old(s_t)
    L       = L_clip - c_ent H[π_θ] + c_vf L_V
π_θold and V_old are the policy and critic of the update's start on every row, also on the rows an env
acted on before the previous update (see `carry_over`), so the ratio starts at 1.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import math
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

# OpenMP threads that sleep, not spin, while they wait (4x faster on a busy 2-core machine): set before torch loads it
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.nn as nn

from ladder.cli import run_command_line
from ladder.distributed import average_gradients
from ladder.flags import RunFlags
from ladder.optim import Adam
from ladder.run import Run

THREADED_FROM_ENVS = 0  # one torch thread per core at any env count: the CNN's convolutions are large


@dataclass(frozen=True)
class Args(RunFlags):
    # The algorithm's flags: a --resume keeps these as the checkpoint has them; after them, run flags' defaults
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

    total_timesteps: int = 10_000_000
    """agent steps (4 frames each), all torchrun ranks together; CleanRL's 10M: 5-11 h on a 2-core CPU (250-540 SPS)"""
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    compile: bool = False
    """torch.compile the network (pays a one-off compile time)"""
    video_interval: int = 100
    """iterations between two videos, the first at iteration 1 (0: no videos during training)"""
    checkpoint_interval: int = 100
    """iterations between checkpoints to <run folder>/checkpoint.pt (0: only at the end, on Ctrl-C or SIGTERM)"""
    eval_episodes: int = 4
    """whole games played by the final policy after training, scored with the real rewards (0 skips)"""

    def __post_init__(self):
        batch_size = self.num_envs * self.num_steps
        rules = {
            "env_id": atari_game_rule(self.env_id),
            "num_envs": (self.num_envs >= 1 + self.async_envs, "positive (--async-envs: at least 2)"),
            "num_steps": (self.num_steps > 0, "positive"),
            "update_epochs": (self.update_epochs > 0, "positive"),
            "num_minibatches": (
                0 < self.num_minibatches <= batch_size,
                f"in [1, --num-envs * --num-steps = {batch_size}]",
            ),
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
            "sweep": (not self.sweep, "left out: EnvPool runs one configuration per process"),
        }
        no_bf16 = "off here: no bfloat16 hardware (AMX or AVX512-BF16 CPUs, GPUs from Ampere on)"
        rules["bf16"] = (not self.bf16 or has_fast_bf16(self.device), f"{no_bf16} to run it faster than float32")
        for name, (ok, rule) in rules.items():  # a ValueError here: one `error:` line (tyro's, shortened)
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(self, name)}")


# Environment ----------------------------------------------------------------------------------
def make_env(env_id: str, num_envs: int, seed: int, batch_size: Optional[int] = None):
    """EnvPool's Atari pool, episodes ending on a lost life, rewards clipped (`info["reward"]`: raw ones)."""
    import envpool

    return envpool.make(
        env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        batch_size=batch_size or num_envs,
        seed=seed,
        episodic_life=True,
        reward_clip=True,
    )


# Agent ----------------------------------------------------------------------------------------
def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    """Orthogonal weights, constant bias (detail 2)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature CNN (Mnih et al. 2015), a trunk shared by the actor and critic heads, on uint8 frames (B, 4, 84, 84);
    `bf16`: the trunk in bfloat16 autocast, the heads in float32."""

    def __init__(self, num_actions: int, bf16: bool = False, channels_last: bool = False):
        super().__init__()
        self.bf16 = bf16
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1.0)
        self.to(memory_format=self.memory_format)

    def forward(self, obs: torch.Tensor):
        obs = obs.contiguous(memory_format=self.memory_format)
        with torch.autocast(obs.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            hidden = self.network(obs.float() / 255.0)
        hidden = hidden.float()
        return self.actor(hidden), self.critic(hidden).squeeze(-1)

    def get_action(self, obs: torch.Tensor, greedy: bool = False):
        """An action (sampled, or the most likely with `greedy`), its log-probability and the value."""
        logits, value = self(obs)
        gumbel = 0.0 if greedy else -torch.empty_like(logits).exponential_().log()  # Gumbel-max sampling
        action = (logits + gumbel).argmax(-1)
        logprob = logits.log_softmax(-1).gather(-1, action.unsqueeze(-1)).squeeze(-1)
        return action, logprob, value

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor):
        logits, value = self(obs)
        logp = logits.log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, action.unsqueeze(-1)).squeeze(-1), entropy, value


# Algorithm ------------------------------------------------------------------------------------
class Rollout(NamedTuple):
    """Every env's steps in its own column, (2T+1, N) tensors on the device, and the pool's bookkeeping. Rows 0..T-1
    are the rollout's steps, row T the observation to bootstrap from; an async env may run past row T while the others
    catch up, hence 2T+1 rows. `terminated`: a life lost; `valid`: False for the reset step after a done."""

    obs: torch.Tensor  # (2T+1, N, 4, 84, 84) uint8
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor
    terminated: torch.Tensor
    dones: torch.Tensor
    valid: torch.Tensor
    filled: np.ndarray  # (N,) rows filled per env
    parked: np.ndarray  # (N,) envs whose last action waits for the next rollout
    game_stats: GameStats
    games: list[tuple[float, int]]  # (score, length) of the games that ended during the last rollout

    @staticmethod
    def empty(num_steps: int, num_envs: int, device: torch.device) -> Rollout:
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(
            2 * num_steps + 1, num_envs, *shape, dtype=dtype, device=device
        )
        flags = (zeros(dtype=torch.bool) for _ in range(3))
        tensors = (zeros(4, 84, 84, dtype=torch.uint8), zeros(dtype=torch.long), zeros(), zeros(), zeros(), *flags)
        return Rollout(*tensors, np.zeros(num_envs, dtype=np.int64), np.zeros(num_envs, bool), GameStats(num_envs), [])


class Batch(NamedTuple):
    """A rollout's T steps of every env, flattened; the reset steps stay in with `mask` 0 and the loss's means skip
    them: a batch of one size whatever the episodes did, which a CUDA graph can hold."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor


@torch.inference_mode()
def collect_rollout(agent: Agent, envs, rollout: Rollout, env_batch: int) -> int:
    """Fill every env's column of `rollout` up to row T with the current policy; return the steps emulated. EnvPool
    hands back `env_batch` envs per `recv`, in any order; an env with its T+1 rows is parked (its action kept for the
    next rollout) while `env_batch` others stay in flight, and the rows an env runs past T go on to the next rollout."""
    T = len(rollout.obs) // 2
    filled, parked, device = rollout.filled, rollout.parked, rollout.obs.device
    if filled.min() > T:
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
        env_steps += int(prev.sum())
    return env_steps


def carry_over(agent: Agent, rollout: Rollout) -> None:
    """Each env's rows past T to the top of its column, valued by the current policy (the next ratio starts at 1)."""
    T = len(rollout.obs) // 2
    for buf in rollout[:8]:
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


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def ppo_loss(agent: Agent, args: Args, batch: Batch):
    """Clipped-surrogate PPO loss, its means over the rows `batch.mask` keeps; returns (loss, statistics)."""
    newlogprob, entropy, newvalue = agent.evaluate(batch.obs, batch.actions)
    logratio = newlogprob - batch.logprobs
    ratio = logratio.exp()
    mean = functools.partial(masked_mean, mask=batch.mask)
    with torch.no_grad():
        approx_kl = mean((ratio - 1) - logratio)  # the k3 estimator (detail 12)
        clipfrac = mean(((ratio - 1.0).abs() > args.clip_coef).float())
    advantages = batch.advantages
    if args.norm_adv:  # torch's std (n - 1) over the kept rows
        centred = advantages - mean(advantages)
        std = ((centred.square() * batch.mask).sum() / (batch.mask.sum() - 1).clamp(min=1.0)).sqrt()
        advantages = centred / (std + 1e-8)
    pg_loss = mean(torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)))
    if args.clip_vloss:
        v_clipped = batch.values + (newvalue - batch.values).clamp(-args.clip_coef, args.clip_coef)
        v_loss = 0.5 * mean(torch.max((newvalue - batch.returns).square(), (v_clipped - batch.returns).square()))
    else:
        v_loss = 0.5 * mean((newvalue - batch.returns).square())
    entropy_loss = mean(entropy)
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


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[R - V] / Var[R] over the rows `mask` keeps; NaN (as CleanRL) for constant returns."""
    var = lambda x: masked_mean((x - masked_mean(x, mask)).square(), mask)
    var_returns = var(returns)
    return torch.where(var_returns == 0, torch.nan, 1 - var(returns - values) / var_returns)


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
    return means | {"losses/explained_variance": explained_variance(batch.values, batch.returns, batch.mask)}


def train(args: Args) -> Agent:
    """Train PPO on the `--env-id` game and return the agent."""
    device, T, N = torch.device(args.device), args.num_steps, args.num_envs
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    env_batch = N // 2 if args.async_envs else N  # async: EnvPool emulates half the envs while the policy acts
    with Run(args, evaluate, record_video) as run:
        # --total-timesteps counts all ranks' steps; --eval-only trains not at all (Run evaluates at the end)
        num_iterations = 0 if args.eval_only else args.total_timesteps // (T * N * world_size)
        envs = make_env(args.env_id, N, args.seed + rank * N, batch_size=env_batch)  # env i gets seed + i
        torch.manual_seed(args.seed + rank)  # under torchrun each rank samples its own actions
        agent = Agent(envs.single_action_space.n, args.bf16, args.channels_last).to(device)
        if args.compile:  # compile the forward pass only, so the weights keep their plain names
            agent.forward = torch.compile(agent.forward)
        optimizer = Adam(agent, lr=args.learning_rate, eps=1e-5)  # eps: detail 3
        initial_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        step = functools.partial(gradient_step, agent, optimizer, ppo_loss, args)
        rollout = Rollout.empty(T, N, device)
        envs.async_reset()
        # --resume: all as the checkpoint left it but EnvPool's games, which start anew (docs/modifying.md)
        run.start(agent, envs, optimizer, num_iterations * T * N * world_size)

        def learn(tensors):
            obs, actions, logprobs, values, rewards, terminated, dones, valid = (x[: T + 1] for x in tensors)
            # rows 0..T-1 are complete steps; row T holds each env's next observation and its value
            advantages, returns = compute_gae(
                rewards[:T], values[:T], values[1:], terminated[:T], dones[:T], args.gamma, args.gae_lambda
            )
            rows = (x[:T].flatten(0, 1) for x in (obs, actions, logprobs))
            mask = valid[:T].flatten().float()  # the reset steps weigh nothing in the loss
            batch = Batch(*rows, advantages.flatten(), returns.flatten(), values[:T].flatten(), mask)
            return update(functools.partial(one_epoch, step), batch, args)

        learn = run.one_call(learn)  # on a GPU: recorded once as a CUDA graph, replayed (--cuda-graph)
        for iteration in run.iterations():
            for group, lr in zip(optimizer.param_groups, initial_lrs) if args.anneal_lr else ():
                group["lr"].fill_((1.0 - (iteration - 1.0) / num_iterations) * lr)  # in place: see ladder/optim.py
            env_steps = collect_rollout(agent, envs, rollout, env_batch)
            stats = learn(rollout[:8])
            run.log(env_steps, stats, finished_episodes(rollout))
            run.film(rollout)
            if run.target_reached():
                break
            run.checkpoint()  # every --checkpoint-interval iterations; last in the loop, so all its state is in it
    return agent


# What train() and the run call: game ids, game scores, evaluation, videos
def atari_game_rule(env_id: str) -> tuple[bool, str]:
    """Whether EnvPool has this Atari game, and the rule, naming the game a misspelt id meant."""
    try:
        import envpool
    except ImportError:
        raise ModuleNotFoundError("this script needs envpool: pip install envpool==1.2.5") from None
    ids = envpool.list_all_envs()  # (a spec's type tells an Atari game; making every spec would import them all)
    if env_id in ids and type(envpool.make_spec(env_id)).__name__ == "AtariEnvSpec":
        return True, ""
    meant = [game for game in difflib.get_close_matches(env_id, ids, n=3, cutoff=0.75) if game.endswith("-v5")]
    return False, "an EnvPool Atari game " + (f"(did you mean {meant[0]}?)" if meant else "(e.g. Pong-v5)")


class GameStats:
    """Real game scores, the raw rewards (`info["reward"]`) over all lives (training's episodes end at every life), a
    game ending with `info["terminated"]` (the last life; Pong has no `lives`) or `truncated`."""

    def __init__(self, num_envs: int):
        self.scores = np.zeros(num_envs, dtype=np.float64)

    def update(self, env_ids, raw_rewards, game_over, elapsed_steps) -> list[tuple[float, int]]:
        self.scores[env_ids] += raw_rewards
        ended = np.asarray(env_ids)[np.asarray(game_over, dtype=bool)]
        lengths = np.asarray(elapsed_steps)[np.asarray(game_over, dtype=bool)]
        games = [(float(self.scores[e]), int(n)) for e, n in zip(ended, lengths)]
        self.scores[ended] = 0.0
        return games


def game_over(info: dict, truncated: np.ndarray) -> np.ndarray:
    return (info["terminated"] == 1) | truncated


def finished_episodes(rollout: Rollout):
    """(ended, return, length), tensors of one shape: the games that ended during `rollout`, with their real scores."""
    games = torch.tensor(rollout.games, dtype=torch.float32, device=rollout.obs.device).view(-1, 2)
    return torch.ones(len(games), dtype=torch.bool, device=rollout.obs.device), games[:, 0], games[:, 1]


def evaluate(agent: Agent, envs, args: Args, video: Optional[str]) -> list[float]:
    """Real score of one whole game in each of `eval-episodes` fresh envs under the sampling policy, on a seeded random
    stream of its own (--eval-only of the saved model plays the same games); `video`: filmed, up to 16. The envs lose
    lives as in training: EnvPool's reset then presses FIRE, which the agent never learned to."""
    n, device = args.eval_episodes, next(agent.parameters()).device
    envs, game_stats, scores, last = make_env(args.env_id, n, args.seed + 1), GameStats(n), np.full(n, np.nan), None
    obs, info = envs.reset()
    ids = info["env_id"]
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        video_writer(video) if video else contextlib.nullcontext() as writer,
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


def video_writer(path: str):
    """An MP4 writer at `path`, 15 agent steps (60 frames) a second; H.264 needs even sides: odd ones are padded."""
    import imageio.v2 as imageio  # (only a run that films imports it)

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return imageio.get_writer(path, fps=15, macro_block_size=2)


def record_video(agent: Agent, envs, rollout: Rollout, args: Args, path: str) -> str:
    with video_writer(path) as writer:
        for frame in grid_video(rollout.obs[: len(rollout.obs) // 2]):
            writer.append_data(frame)
    return path


def grid_video(frames: torch.Tensor) -> np.ndarray:
    """RGB frames (T, rows*84, cols*84, 3) of stacked observations (T, N, 4, 84, 84), up to 16 envs tiled squarely."""
    frames = frames[:, :16, -1]  # the newest frame of each stack
    t, n, h, w = frames.shape
    rows = math.isqrt(n)
    cols = -(-n // rows)
    if n < rows * cols:  # black tiles fill the last row
        frames = torch.cat((frames, frames.new_zeros((t, rows * cols - n, h, w))), dim=1)
    frames = frames.clone()
    frames[:, :, [0, -1]] = 128
    frames[:, :, :, [0, -1]] = 128
    grid = frames.view(t, rows, cols, h, w).permute(0, 1, 3, 2, 4).reshape(t, rows * h, cols * w)
    return grid.unsqueeze(-1).expand(-1, -1, -1, 3).cpu().numpy()


def has_fast_bf16(device: str) -> bool:
    """Whether bfloat16 math runs in hardware on `device` (emulated it is several times slower: docs/benchmarks.md)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch's own cpuinfo checks; a missing one: no
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)


def main() -> None:
    run_command_line(Args, train, THREADED_FROM_ENVS)


if __name__ == "__main__":
    main()
