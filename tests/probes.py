"""Probe environments (Andy Jones, "Debugging RL, Without the Agonizing Pain"), tensor-native.

Each one isolates one thing an agent must get right and has an exact answer for the value
function (and, for 4 and 5, the policy). They share CartPole's interface, so
`train(args, envs=ProbeK(num_envs, device, seed))` runs them.
"""

import torch


class Probe:
    """Base: one-step episodes with a constant observation 0 and reward +1 (probe 1)."""

    obs_dim = 1
    num_actions = 1
    max_episode_steps = 1

    def __init__(self, num_envs: int, device="cpu", seed: int = 0):
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.t = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.obs = self._initial_obs()
        self.episode_return = torch.zeros(num_envs, device=self.device)

    def _initial_obs(self) -> torch.Tensor:
        return torch.zeros(self.num_envs, 1, device=self.device)

    def _coin(self) -> torch.Tensor:
        """A fair 0/1 coin per env, as float, from the env's own generator."""
        return torch.randint(0, 2, (self.num_envs, 1), generator=self.generator, device=self.device).float()

    def reward(self, action: torch.Tensor) -> torch.Tensor:
        return torch.ones(self.num_envs, device=self.device)

    def next_obs(self) -> torch.Tensor:
        """Observation after a step that does not end the episode (multi-step probes only)."""
        return self.obs

    def draw_initial_states(self, num_steps: int, num_envs: int) -> torch.Tensor:
        """(num_steps, num_envs, 1): the observation each env restarts from, per step (see CartPole)."""
        return torch.stack([self._initial_obs() for _ in range(num_steps)])

    def reset(self):
        self.t.zero_()
        self.obs = self._initial_obs()
        self.episode_return.zero_()
        return self.obs, {}

    def step(self, action: torch.Tensor, initial_states=None):
        reward = self.reward(action)
        self.t += 1
        terminated = self.t >= self.max_episode_steps
        truncated = torch.zeros_like(terminated)
        self.episode_return = self.episode_return + reward
        final_obs = torch.where(terminated.unsqueeze(1), self.obs, self.next_obs())
        info = {"final_obs": final_obs, "episode_return": self.episode_return, "episode_length": self.t.int()}
        fresh = self._initial_obs() if initial_states is None else initial_states
        self.obs = torch.where(terminated.unsqueeze(1), fresh, final_obs)
        self.t = self.t.masked_fill(terminated, 0)
        self.episode_return = self.episode_return.masked_fill(terminated, 0.0)
        return self.obs, reward, terminated, truncated, info


class Probe1(Probe):
    """Constant observation, reward +1, one step: V(0) = 1."""


class Probe2(Probe):
    """Observation -1 or +1 at random, reward = observation, one step: V(-1) = -1, V(+1) = +1."""

    def _initial_obs(self):
        return 2 * self._coin() - 1

    def reward(self, action):
        return self.obs[:, 0].clone()


class Probe3(Probe):
    """Two steps, observation 0 then 1, reward +1 only at the second: V(0) = gamma, V(1) = 1."""

    max_episode_steps = 2

    def reward(self, action):
        return (self.t == 1).float()

    def next_obs(self):
        return torch.ones_like(self.obs)


class Probe4(Probe):
    """One observation, two actions, reward -1 for action 0 and +1 for action 1: V = 1, pi = [0, 1]."""

    num_actions = 2

    def reward(self, action):
        return 2 * action.float() - 1


class Probe5(Probe):
    """Observation 0 or 1 at random; reward +1 iff action == observation, else -1.

    V(0) = V(1) = 1, pi(.|0) = [1, 0], pi(.|1) = [0, 1].
    """

    num_actions = 2

    def _initial_obs(self):
        return self._coin()

    def reward(self, action):
        return torch.where(action == self.obs[:, 0].long(), 1.0, -1.0)


PROBES = {1: Probe1, 2: Probe2, 3: Probe3, 4: Probe4, 5: Probe5}
