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
    s is normalised by a running mean/std, r scaled by a running std of the discounted return
    δ_t     = r_t + γ (1 - term_t) V(s'_t) - V(s_t)         s'_t: the real next state, also when
    Â_t     = δ_t + γλ (1 - done_t) Â_{t+1}                       the episode was cut by the time limit
    L_clip  = E[ max(-Â_t r_t(θ), -Â_t clip(r_t(θ), 1-ε, 1+ε)) ],  r_t(θ) = π_θ(a_t|s_t) / π_θold(a_t|s_t)
    L       = L_clip - c_ent H[π_θ] + c_vf ½ E[(V_θ(s_t) - R_t)²]
Defaults follow Brax's own PPO settings for many parallel envs (short unrolls, large batches,
γ = 0.97, 4 epochs, 32 minibatches, ε = 0.3, lr 3e-4).
"""

from __future__ import annotations

import os

# JAX grabs most of a GPU's memory when it starts unless told not to; torch needs its share.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# MuJoCo's renderer (for the MP4 of --capture-video) needs an offscreen OpenGL: EGL, not a window.
os.environ.setdefault("MUJOCO_GL", "egl")

import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Optional  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import tyro  # noqa: E402


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run folder's name)"""
    seed: int = 1
    """seed of the networks, the action sampling and the environments"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """torch device for the policy and the update (cuda when available, else cpu)"""
    torch_threads: int = 0
    """CPU threads for torch; 0 picks one per available core (ignored on GPU)"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "rl-ladder"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team); None uses your default"""
    capture_video: bool = False
    """after training (and every `video-interval` iterations), save brax's HTML viewer of one episode, and an MP4 where an offscreen renderer works"""
    video_interval: int = 0
    """iterations between two videos during training (0: only after training)"""
    save_model: bool = False
    """save the agent's weights and observation statistics to the run folder at the end (also on Ctrl-C)"""
    eval_episodes: int = 16
    """episodes of the deterministic (mean-action) policy evaluated after training (0 skips)"""
    progress_bar: bool = True
    """show a live progress bar with SPS and the recent return"""

    env_id: str = "ant"
    """the Brax environment: ant, halfcheetah, hopper, walker2d, humanoid, inverted_pendulum, inverted_double_pendulum, reacher, pusher"""
    backend: str = "spring"
    """the Brax physics pipeline: spring (fastest), positional, generalized (most accurate) or mjx"""
    episode_length: int = 1000
    """steps after which an episode is truncated"""
    total_timesteps: int = 5_000_000
    """environment steps in total"""
    target_return: Optional[float] = None
    """stop once the mean return of the last 100 episodes reaches this (None: run all steps)"""
    learning_rate: float = 3e-4
    """Adam learning rate"""
    num_envs: int = 2048
    """parallel environments"""
    num_steps: int = 10
    """steps per environment per rollout (Brax's short unrolls)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    gamma: float = 0.97
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    num_minibatches: int = 32
    """minibatches per epoch"""
    update_epochs: int = 4
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    norm_obs: bool = True
    """normalise observations with a running mean and std (kept with the model)"""
    norm_reward: bool = True
    """scale rewards by a running std of the discounted return"""
    clip_coef: float = 0.3
    """surrogate clipping coefficient epsilon"""
    ent_coef: float = 0.0
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """global gradient-norm clipping"""
    target_kl: Optional[float] = None
    """stop the epochs of an update early once the approximate KL exceeds this (None: never)"""


BRAX_ENVS = ("ant", "halfcheetah", "hopper", "walker2d", "humanoid", "inverted_pendulum", "inverted_double_pendulum", "reacher", "pusher")
BACKENDS = ("spring", "positional", "generalized", "mjx")


class UsageError(ValueError):
    """A bad flag, an impossible combination of flags or a missing package: reported in one line."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite."""


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------
def import_brax():
    try:
        import jax
        from brax import envs
    except ImportError:
        raise UsageError("this script needs brax and jax: pip install brax==0.14.2 jax==0.9.2 jaxlib==0.9.2") from None
    return jax, envs


class BraxVecEnv:
    """A batch of Brax envs with gymnasium's vector API and torch tensors on `device`.

    reset() -> (obs, info); step(action) -> (obs, reward, terminated, truncated, info). Finished
    envs are reset inside `step` from fresh random keys; `info` holds, per env and valid where
    terminated | truncated: "final_obs" (the real last observation), "episode_return",
    "episode_length". Arrays cross between JAX and torch through DLPack, without copies when both
    live on the same device.
    """

    def __init__(self, env_id: str, backend: str, num_envs: int, episode_length: int, device, seed: int):
        jax, envs = import_brax()
        import jax.numpy as jnp

        self.jax, self.device = jax, torch.device(device)
        # where JAX computes; torch tensors on another device are moved (copied) across
        self.jax_device = torch.device("cuda" if jax.default_backend() == "gpu" else "cpu")
        self.env = envs.get_environment(env_id, backend=backend)
        self.num_envs, self.max_episode_steps = num_envs, episode_length
        self.obs_dim, self.action_dim = self.env.observation_size, self.env.action_size
        env = self.env

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
            pick = lambda new, old: jnp.where(done.reshape(done.shape + (1,) * (old.ndim - 1)), new, old)  # noqa: E731
            state = jax.tree.map(pick, fresh, nxt)
            out = (state.obs, nxt.reward, terminated, truncated, nxt.obs, ret, length)
            return state, jnp.where(done, 0, length), jnp.where(done, 0.0, ret), key, out

        self._reset, self._step = jax.jit(reset), jax.jit(step)
        self._key = jax.random.PRNGKey(seed)
        self.state = None

    def to_torch(self, x) -> torch.Tensor:
        t = torch.from_dlpack(x)
        return t if t.device == self.device else t.to(self.device)

    def to_jax(self, t: torch.Tensor):
        return self.jax.dlpack.from_dlpack(t.detach().to(self.jax_device).contiguous())

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
# Networks
# ----------------------------------------------------------------------------------------------
class RunningMeanStd(nn.Module):
    """Running mean and variance over batches (Chan et al.'s parallel update), kept as buffers so they save with the model."""

    def __init__(self, shape=(), epsilon: float = 1e-4):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(epsilon, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, *self.mean.shape).double()
        batch_mean, batch_var, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        delta, total = batch_mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.var.copy_((self.var * self.count + batch_var * n + delta.square() * self.count * n / total) / total)
        self.count.copy_(total)

    def normalize(self, x: torch.Tensor, clip: float = 10.0) -> torch.Tensor:
        return ((x - self.mean.float()) / torch.sqrt(self.var.float() + 1e-8)).clamp(-clip, clip)


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """Orthogonal weights, constant bias."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Separate 64-64 tanh actor (Gaussian mean, state-independent log-std) and critic, plus the observation statistics."""

    def __init__(self, obs_dim: int, action_dim: int):
        super().__init__()
        self.obs_rms = RunningMeanStd((obs_dim,))
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )  # fmt: skip
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, action_dim), std=0.01),
        )  # fmt: skip
        self.actor_logstd = nn.Parameter(torch.zeros(action_dim))

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def get_action(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        mean = self.actor_mean(obs)
        return mean if deterministic else mean + self.actor_logstd.exp() * torch.randn_like(mean)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor):
        """Log-probability of `action`, entropy, and value (diagonal Gaussian, summed over action dims)."""
        mean, logstd = self.actor_mean(obs), self.actor_logstd.expand(obs.shape[0], -1)
        logprob = (-0.5 * ((action - mean) / logstd.exp()).square() - logstd - 0.5 * math.log(2 * math.pi)).sum(-1)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + logstd).sum(-1)
        return logprob, entropy, self.get_value(obs)


# ----------------------------------------------------------------------------------------------
# Algorithm
# ----------------------------------------------------------------------------------------------
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


def ppo_loss(agent: Agent, args: Args, obs, actions, old_logprobs, advantages, returns):
    """Clipped-surrogate PPO loss for one minibatch; returns (loss, detached statistics)."""
    newlogprob, entropy, newvalue = agent.evaluate(obs, actions)
    logratio = newlogprob - old_logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    if args.norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    v_loss = 0.5 * (newvalue - returns).square().mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss
    stats = torch.stack((pg_loss, v_loss, entropy_loss, approx_kl, clipfrac, loss)).detach()
    return loss, stats


STAT_NAMES = ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl", "losses/clipfrac", "losses/total_loss")


def evaluate_deterministic(agent: Agent, envs: BraxVecEnv, args: Args, num_episodes: int) -> list[float]:
    """Return of the first episode of `num_episodes` envs of the batch under the mean action (resets `envs`)."""
    obs, _ = envs.reset()
    returns = torch.full((envs.num_envs,), float("nan"), device=obs.device)
    with torch.no_grad():
        for _ in range(envs.max_episode_steps):
            action = agent.get_action(agent.obs_rms.normalize(obs) if args.norm_obs else obs, deterministic=True)
            obs, _, terminated, truncated, info = envs.step(action)
            returns = torch.where((terminated | truncated) & returns.isnan(), info["episode_return"], returns)
            if not returns[:num_episodes].isnan().any():
                break
    return returns[:num_episodes].tolist()


def record_episode(agent: Agent, envs: BraxVecEnv, args: Args, path: str) -> str:
    """Play one episode of env 0 with the mean action; write brax's HTML viewer, and an MP4 if an
    offscreen renderer works. Returns a one-line report. Resets `envs`."""
    from brax.io import html

    jax = envs.jax
    obs, _ = envs.reset()
    states = []
    with torch.no_grad():
        for _ in range(envs.max_episode_steps):
            states.append(jax.tree.map(lambda x: x[0], envs.state.pipeline_state))
            action = agent.get_action(agent.obs_rms.normalize(obs) if args.norm_obs else obs, deterministic=True)
            obs, _, terminated, truncated, _ = envs.step(action)
            if bool(terminated[0] | truncated[0]):
                break
    with open(path + ".html", "w") as f:
        f.write(html.render(envs.env.sys, states))
    try:
        from brax.io import image
        from moviepy import ImageSequenceClip

        frames = image.render_array(envs.env.sys, states, width=320, height=240)
        ImageSequenceClip(list(frames), fps=int(round(1 / envs.env.dt))).write_videofile(path + ".mp4", codec="libx264", audio=False, logger=None)
        return f"wrote {path}.html and {path}.mp4"
    except Exception as e:  # no OpenGL context: headless machine without EGL/OSMesa
        return f"no offscreen renderer for the MP4 ({type(e).__name__}; try MUJOCO_GL=egl on a GPU machine): kept {path}.html"


def validate(args: Args) -> torch.device:
    """Reject bad flags with one clear line (raised as UsageError); return the torch device."""
    positive = ("num_envs", "num_steps", "total_timesteps", "num_minibatches", "update_epochs", "episode_length")
    for name in positive:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.eval_episodes < 0 or args.torch_threads < 0 or args.video_interval < 0:
        raise UsageError("--eval-episodes, --torch-threads and --video-interval must be >= 0")
    if args.eval_episodes > args.num_envs:
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
    if args.env_id not in BRAX_ENVS:
        raise UsageError(f"unknown --env-id {args.env_id!r}; choose one of {', '.join(BRAX_ENVS)}")
    if args.backend not in BACKENDS:
        raise UsageError(f"unknown --backend {args.backend!r}; choose one of {', '.join(BACKENDS)}")
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
    import_brax()
    return device


def train(args: Args) -> Agent:
    """Train PPO on the `--env-id` Brax env and return the agent.

    Writes TensorBoard events and summary.json to runs/<run>; re-raises KeyboardInterrupt after
    writing everything, and raises NonFiniteLossError when the loss stops being finite.
    """
    device = validate(args)
    if device.type == "cpu":
        torch.set_num_threads(args.torch_threads or len(os.sched_getaffinity(0)))
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
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
    envs = BraxVecEnv(args.env_id, args.backend, args.num_envs, args.episode_length, device, args.seed)
    agent = Agent(envs.obs_dim, envs.action_dim).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
    return_rms = RunningMeanStd().to(device)  # of the discounted return, for reward scaling
    discounted_return = torch.zeros(args.num_envs, device=device)

    # rollout storage, preallocated on the device
    T, N = args.num_steps, args.num_envs
    obs_buf = torch.zeros((T, N, envs.obs_dim), device=device)  # normalised as the policy saw them
    final_obs_buf = torch.zeros_like(obs_buf)
    actions_buf = torch.zeros((T, N, envs.action_dim), device=device)
    rewards_buf = torch.zeros((T, N), device=device)
    terminated_buf = torch.zeros((T, N), dtype=torch.bool, device=device)
    dones_buf = torch.zeros_like(terminated_buf)
    ep_return_buf = torch.zeros((T, N), device=device)
    ep_length_buf = torch.zeros((T, N), dtype=torch.int32, device=device)

    def normalize(x):
        return agent.obs_rms.normalize(x) if args.norm_obs else x

    recent_returns: deque[float] = deque(maxlen=100)
    global_step, status, episodes = 0, "error", 0
    progress = None
    if args.progress_bar:
        from tqdm import tqdm

        progress = tqdm(total=num_iterations * batch_size, unit="step", unit_scale=True, dynamic_ncols=True)
    compile_start = time.perf_counter()
    raw_obs, _ = envs.reset()
    envs.step(torch.zeros(N, envs.action_dim, device=device))  # jit-compile reset and step before the clock starts
    raw_obs, _ = envs.reset()
    compile_seconds = time.perf_counter() - compile_start
    start_time = time.perf_counter()
    try:
        for iteration in range(1, num_iterations + 1):
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate

            with torch.no_grad():
                raw_obs_seen = []
                for t in range(T):
                    obs = normalize(raw_obs)
                    obs_buf[t] = obs
                    raw_obs_seen.append(raw_obs)
                    action = agent.get_action(obs)
                    raw_obs, reward, terminated, truncated, info = envs.step(action)
                    done = terminated | truncated
                    if args.norm_reward:
                        discounted_return = discounted_return * args.gamma + reward
                        return_rms.update(discounted_return)
                        discounted_return = discounted_return.masked_fill(done, 0.0)
                        reward = reward / torch.sqrt(return_rms.var.float() + 1e-8)
                    actions_buf[t] = action
                    rewards_buf[t] = reward
                    terminated_buf[t] = terminated
                    dones_buf[t] = done
                    final_obs_buf[t] = normalize(info["final_obs"])
                    ep_return_buf[t] = info["episode_return"]
                    ep_length_buf[t] = info["episode_length"]
                global_step += batch_size

                b_obs = obs_buf.view(batch_size, -1)
                b_actions = actions_buf.view(batch_size, -1)
                b_logprobs, _, b_values = agent.evaluate(b_obs, b_actions)
                next_values = agent.get_value(final_obs_buf.view(batch_size, -1)).view(T, N)
                advantages, returns = compute_gae(
                    rewards_buf, b_values.view(T, N), next_values, terminated_buf, dones_buf, args.gamma, args.gae_lambda
                )
                if args.norm_obs:  # statistics for the next rollout, from the raw observations of this one
                    agent.obs_rms.update(torch.stack(raw_obs_seen))
            b_advantages, b_returns = advantages.view(-1), returns.view(-1)

            stats = torch.zeros(len(STAT_NAMES), device=device)
            updates = 0
            for _ in range(args.update_epochs):
                perm = torch.randperm(batch_size, device=device)  # shuffled on the device
                for start in range(0, batch_size, minibatch_size):
                    mb = perm[start : start + minibatch_size]
                    loss, mb_stats = ppo_loss(agent, args, b_obs[mb], b_actions[mb], b_logprobs[mb], b_advantages[mb], b_returns[mb])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()
                    stats += mb_stats
                    epoch_kl = mb_stats[3]
                    updates += 1
                if args.target_kl is not None and epoch_kl.item() > args.target_kl:
                    break

            # the host reads of the iteration, for logging: losses and the finished episodes
            explained_var = 1 - (b_returns - b_values).var() / b_returns.var()
            *stats, explained_var = torch.cat((stats / updates, explained_var.view(1))).tolist()
            if not all(math.isfinite(v) for v in stats):
                status = "non-finite loss"
                raise NonFiniteLossError(f"non-finite loss at iteration {iteration} (env step {global_step})")
            finished = torch.stack((ep_return_buf, ep_length_buf.float()), dim=-1)[dones_buf].tolist()
            done_returns = [r for r, _ in finished]
            done_lengths = [l for _, l in finished]
            recent_returns.extend(done_returns)
            episodes += len(done_returns)
            elapsed = time.perf_counter() - start_time
            sps = int(global_step / elapsed)
            mean_recent = float(np.mean(recent_returns)) if recent_returns else float("nan")

            if done_returns:
                writer.add_scalar("charts/episodic_return", float(np.mean(done_returns)), global_step)
                writer.add_scalar("charts/episodic_length", float(np.mean(done_lengths)), global_step)
            writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
            writer.add_scalar("charts/SPS", sps, global_step)
            for name, value in zip(STAT_NAMES, stats):
                writer.add_scalar(name, value, global_step)
            writer.add_scalar("losses/explained_variance", explained_var, global_step)
            if progress is not None:
                progress.update(batch_size)
                progress.set_postfix(SPS=sps, ret=f"{mean_recent:.1f}", refresh=False)

            if args.capture_video and args.video_interval and iteration % args.video_interval == 0:
                os.makedirs(os.path.join(run_dir, "videos"), exist_ok=True)
                print(record_episode(agent, envs, args, os.path.join(run_dir, "videos", f"episode_iter{iteration:05d}")))
                raw_obs, _ = envs.reset()

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
            "backend": args.backend,
            "exp_name": args.exp_name,
            "seed": args.seed,
            "device": str(device),
            "status": status,
            "total_env_steps": global_step,
            "wall_seconds": round(elapsed, 3),
            "compile_seconds": round(compile_seconds, 3),
            "mean_sps": round(global_step / elapsed, 1) if elapsed > 0 else 0.0,
            "episodes": episodes,
            "mean_return_last_100": float(np.mean(recent_returns)) if recent_returns else None,
        }
        if status != "non-finite loss":  # NaN weights are not worth saving
            if args.save_model:
                model_path = os.path.join(run_dir, f"{args.exp_name}.cleanrl_model")
                torch.save(agent.state_dict(), model_path)  # the observation statistics included
                summary["model_path"] = model_path
            if status in ("completed", "target return reached"):
                if args.eval_episodes:
                    eval_returns = evaluate_deterministic(agent, envs, args, args.eval_episodes)
                    summary["eval_returns"] = eval_returns
                    summary["eval_mean_return"] = float(np.mean(eval_returns))
                    writer.add_scalar("eval/episodic_return", summary["eval_mean_return"], global_step)
                if args.capture_video:
                    os.makedirs(os.path.join(run_dir, "videos"), exist_ok=True)
                    summary["video"] = record_episode(agent, envs, args, os.path.join(run_dir, "videos", "episode_final"))
                    print(summary["video"])
        summary["args"] = asdict(args)
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(
            f"{status}: {global_step:,} steps in {elapsed:.1f} s ({summary['mean_sps']:,.0f} SPS, after {compile_seconds:.1f} s of jit); "
            f"mean return of the last 100 episodes {summary['mean_return_last_100']}; "
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
