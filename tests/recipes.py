"""docs/modifying.md's recurrent-policy recipe as the edits it makes to a copy of ppo_cartpole_gpu.py (or vpg.py):
each edit is (the line(s) of the script, what the copy has instead). `recurrent_copy` writes the copy and imports it;
tests/test_modifications.py trains it in every mode and tests/dp_worker.py under torchrun, and a test checks that
the docs show these edits as they are here."""

# ruff: noqa: E501 (the edits quote the script's lines inside string literals, at their indentation)
import difflib
import importlib.util
import os
import sys

RECURRENT = [
    (
        "from ladder.run import Run\n",
        "from ladder.run import PerRank, Run\n",
    ),
    (
        'env_id: Literal["CartPole-v1", "EasyCart-v1", "SpinCart-v1"] = "CartPole-v1"',
        'env_id: Literal["CartPole-v1", "EasyCart-v1", "SpinCart-v1", "PositionsCart-v1"] = "PositionsCart-v1"',
    ),
    (
        "# Agent ----------------------------------------------------------------------------------------\n",
        '''class PositionsCart(CartPole):
    """CartPole-v1 without the velocities: the observation is (x, θ), so the policy must remember to balance."""

    obs_dim = 2

    def reset(self):
        return super().reset()[0][:, ::2], {}

    def step(self, action: torch.Tensor, initial_states: Optional[torch.Tensor] = None):
        obs, reward, terminated, truncated, info = super().step(action, initial_states)
        return obs[:, ::2], reward, terminated, truncated, info | {"final_obs": info["final_obs"][:, ::2]}

    def load_state_dict(self, saved: dict) -> torch.Tensor:
        return super().load_state_dict(saved)[:, ::2]


# Agent ----------------------------------------------------------------------------------------
HIDDEN_SIZE = 16  # each network's GRU state


class Recall(nn.Module):
    """h_t = GRU(o_t, h_{t-1}), from the inputs (o_t, then both networks' h_{t-1}): the slice `hidden` is its own."""

    def __init__(self, obs_dim: int, hidden: slice):
        super().__init__()
        self.obs_dim, self.hidden, self.gru = obs_dim, hidden, nn.GRUCell(obs_dim, hidden.stop - hidden.start)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.gru(inputs[..., : self.obs_dim], inputs[..., self.hidden])


class Memory(nn.Module):
    """Each env's h_{t-1}, both networks', between steps and iterations; each torchrun rank's own (as its envs)."""

    def __init__(self, num_envs: int, device: torch.device):
        super().__init__()
        self.register_buffer("hidden", torch.zeros(num_envs, 2 * HIDDEN_SIZE, device=device))
''',
    ),
    (
        "        self.critic, self.actor = mlp(obs_dim, 1, out_std=1.0), mlp(obs_dim, num_actions, out_std=0.01)\n",
        """        h, size = obs_dim + HIDDEN_SIZE, HIDDEN_SIZE  # the inputs: o_t, the critic's h_{t-1}, the actor's
        self.critic = nn.Sequential(Recall(obs_dim, slice(obs_dim, h)), mlp(size, 1, out_std=1.0))
        self.actor = nn.Sequential(Recall(obs_dim, slice(h, h + size)), mlp(size, num_actions, out_std=0.01))

    def remember(self, inputs: torch.Tensor) -> torch.Tensor:
        \"\"\"Both networks' h_t: what the next step's inputs carry.\"\"\"
        return torch.cat((self.critic[0](inputs), self.actor[0](inputs)), -1)
""",
    ),
    (
        "def collect_rollout(agent: Agent, envs, obs: torch.Tensor, rollout: Rollout, noise: RolloutNoise) -> torch.Tensor:",
        "def collect_rollout(agent: Agent, envs, obs: torch.Tensor, rollout: Rollout, noise: RolloutNoise, memory):",
    ),
    (
        """            rollout.obs[t] = obs
            action = agent.get_action(obs, noise.gumbel[t])
""",
        """            obs = torch.cat((obs, memory.hidden), -1)  # the policy's inputs: o_t and h_{t-1}
            rollout.obs[t] = obs
            action = agent.get_action(obs, noise.gumbel[t])
            hidden = agent.remember(obs)
""",
    ),
    (
        """            rollout.dones[t], rollout.final_obs[t] = terminated | truncated, info["final_obs"]
""",
        """            rollout.dones[t], rollout.final_obs[t] = terminated | truncated, torch.cat((info["final_obs"], hidden), -1)
            memory.hidden.copy_(hidden.masked_fill((terminated | truncated).unsqueeze(-1), 0.0))  # a new episode: 0
""",
    ),
    (
        '                group["first_lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64, device=device)\n',
        '                group["first_lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64, device=device)\n            memory = Memory(N, device)\n',
    ),
    (
        "        rollout = run.each(Rollout.empty, T, N, envs.obs_dim, device)\n",
        "        rollout = run.each(Rollout.empty, T, N, envs.obs_dim + 2 * HIDDEN_SIZE, device)\n",
    ),
    (
        "* world_size, envs.reset()[0])\n",
        "* world_size, envs.reset()[0],\n                            memory=PerRank(memory))  # each rank's own, saved per rank\n",
    ),
    (
        "(agent, envs, obs, rollout, noise)\n",  # PPO's `collect`, VPG's `collect_rollout`
        "(agent, envs, obs, rollout, noise, memory)\n",
    ),
    (
        """ENVS = {"CartPole-v1": CartPole, "EasyCart-v1": EasyCart, "SpinCart-v1": SpinCart}  # --env-id's""",
        """ENVS = {"CartPole-v1": CartPole, "EasyCart-v1": EasyCart, "SpinCart-v1": SpinCart, "PositionsCart-v1": PositionsCart}""",
    ),
    (
        """    returns, frames = torch.full((envs.num_envs,), float("nan"), device=envs.device), []
""",
        """    returns, frames = torch.full((envs.num_envs,), float("nan"), device=envs.device), []
    hidden = torch.zeros(envs.num_envs, 2 * HIDDEN_SIZE, device=envs.device)
""",
    ),
    (
        """            obs, _, terminated, truncated, info = envs.step(agent.get_action(obs))
""",
        """            inputs = torch.cat((obs, hidden), -1)
            obs, _, terminated, truncated, info = envs.step(agent.get_action(inputs))
            hidden = agent.remember(inputs)
""",
    ),
]
"""The recurrent recipe: a GRU in front of the actor and of the critic, trained with one step of backpropagation
through time (the stored h_{t-1} is an input, as R2D2 stores the recurrent state), on a CartPole without
velocities."""


RUNNING_MEAN_STD = (
    "# Agent ----------------------------------------------------------------------------------------\n",
    '''# Agent ----------------------------------------------------------------------------------------
class RunningMeanStd(nn.Module):
    """Running mean and variance of batches of x (Chan et al.'s parallel update), in float64 buffers of the agent: the
    checkpoint, --save-model and each seed (--num-seeds) keep them; each torchrun rank keeps its own (as gymnasium's
    NormalizeObservation does in each process), saved and resumed as its own."""

    def __init__(self, shape: tuple = (), epsilon: float = 1e-4):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(epsilon, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:  # in place (.add_, .copy_): what every mode keeps
        x = x.reshape(-1, *self.mean.shape).double()
        batch_mean, batch_var, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        delta, total = batch_mean - self.mean, self.count + n
        self.mean.add_(delta * n / total)
        self.var.copy_((self.var * self.count + batch_var * n + delta.square() * self.count * n / total) / total)
        self.count.copy_(total)

    def normalize(self, x: torch.Tensor, clip: float = 10.0) -> torch.Tensor:
        return ((x - self.mean.float()) / (self.var.float() + 1e-8).sqrt()).clamp(-clip, clip)


''',
)
"""A running mean and variance, shared by the observation-normalisation and RND recipes."""

AGENT_LINE = "        self.critic, self.actor = mlp(obs_dim, 1, out_std=1.0), mlp(obs_dim, num_actions, out_std=0.01)\n"
NEXT_VALUES = "        next_values = agent.get_value(rollout.final_obs.view(T * N, -1)).view(T, N)\n"
ARGS_END = '''    """stop the epochs of an update early once the approximate KL exceeds this (None: never)"""\n'''
OPTIMIZER = "            optimizer = Adam(agent, lr=args.learning_rate, eps=1e-5)  # eps: detail 3\n"

OBSERVATION_NORMALISATION = [
    RUNNING_MEAN_STD,
    (AGENT_LINE, AGENT_LINE + "        self.obs_rms = RunningMeanStd((obs_dim,))  # the observations' statistics\n"),
    (
        "            rollout.obs[t] = obs\n",
        """            agent.obs_rms.update(obs)  # each observation joins the statistics, then the policy sees it normalised
            obs = agent.obs_rms.normalize(obs)
            rollout.obs[t] = obs
""",
    ),
    (
        """rollout.final_obs[t] = terminated | truncated, info["final_obs"]\n""",
        """rollout.final_obs[t] = terminated | truncated, agent.obs_rms.normalize(info["final_obs"])\n""",
    ),
    (
        "            obs, _, terminated, truncated, info = envs.step(agent.get_action(obs))\n",
        """            action = agent.get_action(agent.obs_rms.normalize(obs))
            obs, _, terminated, truncated, info = envs.step(action)
""",
    ),
]
"""Running observation normalisation (gymnasium's NormalizeObservation): statistics in the agent, updated by each
observation the rollout meets, the rollout holding normalised observations."""

RND = [
    RUNNING_MEAN_STD,
    (
        ARGS_END,
        ARGS_END
        + '''    intrinsic_coef: float = 0.1
    """weight of the intrinsic reward: the RND predictor's error on the next observation, over its running std"""
    rnd_learning_rate: float = 1e-3
    """Adam learning rate of the RND predictor (a param group of its own)"""
''',
    ),
    (
        AGENT_LINE,
        AGENT_LINE
        + """        # RND (Burda et al. 2018): a fixed random network, a predictor trained to match it, its error's statistics
        self.rnd_target = mlp(obs_dim, 16, out_std=1.0).requires_grad_(False)
        self.rnd_predictor = mlp(obs_dim, 16, out_std=1.0)
        self.surprise_rms = RunningMeanStd()
""",
    ),
    (
        NEXT_VALUES,
        NEXT_VALUES
        + """        final_obs = rollout.final_obs.view(T * N, -1)  # the intrinsic reward: how new the next observation is
        surprise = (agent.rnd_predictor(final_obs) - agent.rnd_target(final_obs)).square().mean(-1)
        agent.surprise_rms.update(surprise)
        rewards = rollout.rewards + args.intrinsic_coef * (surprise / agent.surprise_rms.var.float().sqrt()).view(T, N)
""",
    ),
    ("        rollout.rewards, values.view(T, N), next_values,", "        rewards, values.view(T, N), next_values,"),
    (
        "    loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss\n",
        """    loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss
    rnd_loss = (agent.rnd_predictor(batch.obs) - agent.rnd_target(batch.obs)).square().mean()  # the predictor learns
    loss = loss + rnd_loss
""",
    ),
    (
        """        "losses/total_loss": loss,\n""",
        """        "losses/total_loss": loss,\n        "losses/rnd_loss": rnd_loss,\n""",
    ),
    (
        OPTIMIZER,
        """            policy = [p for name, p in agent.named_parameters() if p.requires_grad and not name.startswith("rnd_")]
            groups = [{"params": policy}, {"params": agent.rnd_predictor.parameters(), "lr": args.rnd_learning_rate}]
            optimizer = Adam(agent, groups, lr=args.learning_rate, eps=1e-5)  # eps: detail 3
""",
    ),
]
"""An exploration bonus by random network distillation: the predictor a param group of the agent's one optimizer (so
every mode steps it, --num-seeds too), its error normalised by running statistics, added to the reward in
`make_batch` (one return stream: the paper keeps two)."""

POLYAK_TARGET = [
    ("import functools\n", "import copy\nimport functools\n"),
    (
        ARGS_END,
        ARGS_END
        + '''    polyak_tau: float = 0.05
    """the target critic moves this share of the way to the critic after each iteration"""
''',
    ),
    (
        AGENT_LINE,
        AGENT_LINE
        + "        self.target_critic = copy.deepcopy(self.critic).requires_grad_(False)  # bootstraps GAE\n",
    ),
    (
        NEXT_VALUES,
        "        next_values = agent.target_critic(rollout.final_obs.view(T * N, -1)).squeeze(-1).view(T, N)\n",
    ),
    (
        "            obs, stats = one_iteration(obs, run.each(RolloutNoise.draw, envs, T), rollout)\n",
        """            obs, stats = one_iteration(obs, run.each(RolloutNoise.draw, envs, T), rollout)
            with torch.no_grad():  # Polyak averaging: the target critic a step towards the critic
                for target, online in zip(agent.target_critic.parameters(), agent.critic.parameters()):
                    target.lerp_(online, args.polyak_tau)
""",
    ),
]
"""A target critic for the bootstrap values, updated by Polyak averaging (as DQN's soft target updates); frozen, it is
not among the parameters ladder's Adam takes of the agent."""

RECIPES = {"observation normalisation": OBSERVATION_NORMALISATION, "RND": RND, "Polyak target": POLYAK_TARGET}

# docs/modifying.md's "Coming from CleanRL": CleanRL's update lines in gradient_step, with ladder's Adam or torch's
CLEANRL_UPDATE = [
    (
        """    optimizer.zero_grad()
    stats = optimizer.backward(loss_fn, agent, args, minibatch)  # loss.backward(), vmapped too (--num-seeds)
    stats = average_gradients(agent, stats)  # data parallel under torchrun; the stats: the ranks' means
    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm, foreach=False)  # vmap has no fused norms
""",
        """    loss, stats = loss_fn(agent, args, minibatch)
    optimizer.zero_grad()
    loss.backward()
    stats = average_gradients(agent, stats)  # data parallel under torchrun; the stats: the ranks' means
    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
""",
    ),
]
ADAM_LINE = "            optimizer = Adam(agent, lr=args.learning_rate, eps=1e-5)  # eps: detail 3\n"
TORCH_SGD = CLEANRL_UPDATE + [
    (
        ADAM_LINE,
        "            lr = torch.tensor(args.learning_rate, device=device)  # a tensor: --anneal-lr sets it in place\n"
        "            optimizer = torch.optim.SGD(agent.parameters(), lr=lr, momentum=0.9, foreach=False)\n",
    )
]
STEP_ANCHOR = "def gradient_step(agent: nn.Module, optimizer: Adam, loss_fn, args, batch, idx=None) -> dict:\n"
FLAT_SGD = [
    (
        STEP_ANCHOR,
        '''class SGD(Adam):
    """SGD with momentum on ladder's flat vector: Adam's parameters, backward and state (the velocity: exp_avg)."""

    def step(self, closure=None):
        grad, velocity = self.flat_grad(), self.state["flat"]["exp_avg"]
        for group, p, g, v in zip(self.param_groups, *(x.split(self.sizes) for x in (self.flat, grad, velocity))):
            v.mul_(0.9).add_(g)
            p.sub_(group["lr"] * v)


'''
        + STEP_ANCHOR,
    ),
    (ADAM_LINE, "            optimizer = SGD(agent, lr=args.learning_rate)\n"),
]
FLAT_RMSPROP = [
    (
        STEP_ANCHOR,
        '''class RMSprop(Adam):
    """RMSprop on ladder's flat vector: Adam's parameters, backward and state (the squares' average: exp_avg_sq)."""

    def step(self, closure=None):
        grad, square_avg = self.flat_grad(), self.state["flat"]["exp_avg_sq"]
        for group, p, g, v in zip(self.param_groups, *(x.split(self.sizes) for x in (self.flat, grad, square_avg))):
            v.mul_(0.99).add_(g * g, alpha=0.01)
            p.sub_(group["lr"] * g / (v.sqrt() + group["eps"]))


'''
        + STEP_ANCHOR,
    ),
    (ADAM_LINE, "            optimizer = RMSprop(agent, lr=args.learning_rate, eps=1e-5)\n"),
]
# docs/modifying.md's "Sweeping --max-grad-norm": the clip with a tensor max norm, which torch's reads with float()
SWEPT_CLIP = [
    (
        """    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm, foreach=False)  # vmap has no fused norms
""",
        """    grads = [p.grad for p in agent.parameters() if p.grad is not None]  # clip_grad_norm_, its max norm a tensor
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for g in grads:
        g.mul_(torch.clamp(args.max_grad_norm / (norm + 1e-6), max=1.0))
""",
    ),
]
CLEANRL = {"CleanRL's update": CLEANRL_UPDATE, "torch.optim.SGD": TORCH_SGD, "SGD": FLAT_SGD, "RMSprop": FLAT_RMSPROP}
ALL_THREE = OBSERVATION_NORMALISATION + RND[1:] + POLYAK_TARGET
"""The three recipes in one copy (RND's `RunningMeanStd`: the first's)."""


def apply(source: str, edits: list, name: str) -> str:
    """`source` with every edit made; an edit whose line the source lacks fails with that line."""
    for old, new in edits:
        assert source.count(old) == 1, f"{name} has not exactly once the line the recipe changes: {old.strip()}"
        source = source.replace(old, new)
    return source


def recurrent_copy(script_file: str, folder: str):
    """The recurrent recipe applied to `script_file`, written into `folder` as recurrent_<name>.py and imported."""
    return recipe_copy(script_file, folder, RECURRENT, "recurrent")


def recipe_copy(script_file: str, folder: str, edits: list, prefix: str):
    """`edits` applied to `script_file`, written into `folder` as <prefix>_<name>.py and imported."""
    name = f"{prefix}_" + os.path.basename(script_file).removesuffix(".py")
    path = os.path.join(folder, name + ".py")
    with open(script_file) as f:
        source = apply(f.read(), edits, os.path.basename(script_file))
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def recipe_diff(script_file: str, edits: list) -> str:
    """The edits as a diff of `script_file` without context or line numbers, as docs/modifying.md shows it."""
    with open(script_file) as f:
        source = f.read()
    new = apply(source, edits, os.path.basename(script_file))
    lines = difflib.unified_diff(source.splitlines(), new.splitlines(), lineterm="", n=0)
    return "\n".join("@@" if line.startswith("@@") else line for line in list(lines)[2:])
