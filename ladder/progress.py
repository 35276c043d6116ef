"""The progress of K seeds' runs in arrays, a row each: an iteration updates all K with no Python per seed."""

import math

import numpy as np

WINDOW = 100  # the episodes a return's running mean covers (CleanRL's, and gymnasium's "solved" rule)


class Progress:
    """The counters and training clock (alike for all seeds), and each seed's episodes, last 100 returns (a ring),
    when its mean first reached the env's solved level (NaN: not yet), whether it reached --target-return."""

    def __init__(self, k: int):
        self.k, self.iteration, self.global_step, self.seconds, self.timed_steps = k, 0, 0, 0.0, 0
        self.episodes, self.count = np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.int64)
        self.returns = np.full((k, WINDOW), np.nan)
        self.solved_step, self.solved_seconds = np.full(k, np.nan), np.full(k, np.nan)
        self.target_reached = np.zeros(k, dtype=bool)

    def record(self, numbers: np.ndarray, tags: list, seconds, threshold) -> tuple[list, np.ndarray]:
        """An iteration from the host's numbers, a row per seed (steps, stop signal, rate, `tags`' values, episodes'
        ended, return, length); `seconds` None: not timed. Returns the scalars' tags and a column each."""
        n, k = len(tags), len(numbers)
        steps, values = int(numbers[0, 0]), numbers[:, 3 : 3 + n]
        ended, returns, lengths = numbers[:, 3 + n :].reshape(k, 3, -1).transpose(1, 0, 2)
        self.iteration, self.global_step = self.iteration + 1, self.global_step + steps
        losses = [j for j, tag in enumerate(tags) if tag.startswith("losses/") and "explained" not in tag]
        if not np.isfinite(values[:, losses]).all():  # explained variance is NaN for constant returns
            raise FloatingPointError(f"non-finite loss at iteration {self.iteration} (env step {self.global_step})")
        if seconds is not None:
            self.seconds, self.timed_steps = self.seconds + seconds, self.timed_steps + steps
        new, mean = self.add_episodes(ended > 0, returns), self.mean()
        if threshold is not None:
            solved = np.isnan(self.solved_step) & (mean >= threshold)
            self.solved_step[solved], self.solved_seconds[solved] = self.global_step, self.seconds
        with np.errstate(invalid="ignore", divide="ignore"):  # no episode ended: NaN, no value
            episodic = [(returns * (ended > 0)).sum(1) / new, (lengths * (ended > 0)).sum(1) / new]
        tags = ["charts/learning_rate", "charts/SPS", *tags, "charts/episodic_return", "charts/episodic_length"]
        return tags, np.column_stack([numbers[:, 2], np.full(k, self.sps() or np.nan), values, *episodic])

    def sps(self):
        return int(self.timed_steps / self.seconds) if self.seconds else None

    def add_episodes(self, ended: np.ndarray, returns: np.ndarray) -> np.ndarray:
        """The episodes that ended in an iteration ([K, M]: `ended` a mask), the last 100 of each seed kept."""
        new = ended.sum(1)
        seeds, where = np.nonzero(ended)  # by seed, each seed's in the rollout's order
        rank = np.arange(len(seeds)) - np.repeat(np.cumsum(new) - new, new)  # 0, 1, ... within each seed's
        keep = rank >= new[seeds] - WINDOW  # a seed with more than 100 new ones: its last 100
        seeds, where, rank = seeds[keep], where[keep], rank[keep]
        self.returns[seeds, (self.count[seeds] + rank) % WINDOW] = returns[seeds, where]  # over the oldest
        self.episodes += new
        self.count += new
        return new

    def mean(self, full: bool = True) -> np.ndarray:
        """Each seed's mean return over its last 100 episodes; -inf until 100 have ended (`full`), else NaN for none."""
        filled = np.minimum(self.count, WINDOW)  # the ring's slots not filled yet are NaN
        mean = np.divide(np.nansum(self.returns, 1), filled, out=np.full(len(filled), np.nan), where=filled > 0)
        return np.where(self.count >= WINDOW, mean, -math.inf) if full else mean

    def recent(self, seed: int) -> list[float]:
        """Seed `seed`'s last (up to) 100 returns, oldest first."""
        filled = min(int(self.count[seed]), WINDOW)
        return np.roll(self.returns[seed], -int(self.count[seed] % WINDOW) if filled == WINDOW else 0)[:filled].tolist()

    def counters(self, seed: int) -> dict:
        solved = not math.isnan(self.solved_step[seed])
        step, seconds = (int(self.solved_step[seed]), float(self.solved_seconds[seed])) if solved else (None, None)
        c = dict(iteration=self.iteration, global_step=self.global_step, seconds=self.seconds)
        c |= dict(timed_steps=self.timed_steps, episodes=int(self.episodes[seed]))
        return c | dict(target_reached=bool(self.target_reached[seed]), solved_step=step, solved_seconds=seconds)

    def restore(self, seed: int, counters: dict, recent: list[float]) -> None:
        self.iteration, self.global_step = counters["iteration"], counters["global_step"]
        self.seconds, self.timed_steps = counters["seconds"], counters["timed_steps"]
        self.episodes[seed], self.target_reached[seed] = counters["episodes"], counters["target_reached"]
        for key in ("solved_step", "solved_seconds"):
            getattr(self, key)[seed] = math.nan if counters[key] is None else counters[key]
        self.count[seed], self.returns[seed] = len(recent), np.nan
        self.returns[seed, : len(recent)] = recent
