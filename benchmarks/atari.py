"""Atari training throughput of ppo_atari_envpool.py vs a CleanRL-style baseline, side by side in one run.

The baseline is written below in the style of CleanRL's ppo_atari_envpool.py (synchronous
`envs.step`, a float32 observation buffer, `torch.distributions.Categorical`, per-tensor Adam,
no channels-last) at the same settings: same game, envs, steps, minibatches, epochs, network,
threads and device. Prints one markdown table with the command and the machine.

    python benchmarks/atari.py                          # Breakout-v5, 3 iterations of 8 envs x 128 steps each
    python benchmarks/atari.py --env-id Pong-v5 --iterations 5
    python benchmarks/atari.py --iterations 5 --repeats 3 --skip-bf16   # the float32 rows, 3 rounds
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import time
from contextlib import redirect_stdout
from dataclasses import dataclass

import envpool
import numpy as np
import torch
import torch.nn as nn
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_atari_envpool as ours  # noqa: E402
from common import cores, machine, train_and_summarize  # noqa: E402


@dataclass
class BenchArgs:
    env_id: str = "Breakout-v5"
    """the game"""
    iterations: int = 3
    """PPO iterations (rollout + update) per measurement"""
    num_envs: int = 8
    """parallel games"""
    num_steps: int = 128
    """steps per env per rollout"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """torch device for both"""
    repeats: int = 1
    """measure every row this many times, round-robin (shared machines drift): the table shows the median and
    the range"""
    skip_bf16: bool = False
    """leave out the --bf16 rows (minutes each on a CPU without bf16 hardware)"""


def run_ours(bench: BenchArgs, **overrides) -> float:
    """Mean training SPS of ppo_atari_envpool.py over `bench.iterations` iterations."""
    args = ours.Args(env_id=bench.env_id, num_envs=bench.num_envs, num_steps=bench.num_steps, device=bench.device,
                     total_timesteps=bench.num_envs * bench.num_steps * bench.iterations, eval_episodes=0,
                     progress_bar=False, **overrides)  # fmt: skip
    return train_and_summarize(ours, args)["mean_sps"]


def cleanrl_baseline(bench: BenchArgs, seed: int = 1) -> float:
    """Training SPS of a CleanRL-style PPO loop at CleanRL's Atari settings (lr 2.5e-4, 4 minibatches,
    4 epochs, clip 0.1, ent 0.01, vf 0.5, grad norm 0.5, gamma 0.99, lambda 0.95)."""
    device = torch.device(bench.device)
    num_envs, num_steps = bench.num_envs, bench.num_steps
    batch, minibatch = num_envs * num_steps, num_envs * num_steps // 4
    envs = envpool.make(
        bench.env_id, env_type="gymnasium", num_envs=num_envs, seed=seed, episodic_life=True, reward_clip=True
    )
    torch.manual_seed(seed)
    np.random.seed(seed)
    agent = ours.Agent(envs.single_action_space.n).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)

    def get_action_and_value(x, action=None):
        hidden = agent.network(x / 255.0)
        dist = torch.distributions.Categorical(logits=agent.actor(hidden))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), agent.critic(hidden).squeeze(-1)

    obs = torch.zeros((num_steps, num_envs, 4, 84, 84), device=device)
    actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
    logprobs, rewards, dones, values = (torch.zeros((num_steps, num_envs), device=device) for _ in range(4))
    next_obs = torch.tensor(envs.reset()[0], dtype=torch.float32, device=device)
    next_done = torch.zeros(num_envs, device=device)
    episode_returns = np.zeros(num_envs)
    global_step, start = 0, time.perf_counter()
    for iteration in range(1, bench.iterations + 1):
        optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / bench.iterations) * 2.5e-4
        for step in range(num_steps):
            global_step += num_envs
            obs[step], dones[step] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = get_action_and_value(next_obs)
            values[step], actions[step], logprobs[step] = value, action, logprob
            o, r, term, trunc, info = envs.step(action.cpu().numpy())
            episode_returns += info["reward"]  # game-score bookkeeping, as CleanRL's wrapper does
            episode_returns[(info["terminated"] == 1) | trunc] = 0.0
            rewards[step] = torch.tensor(r, device=device)
            next_obs = torch.tensor(o, dtype=torch.float32, device=device)
            next_done = torch.tensor(np.logical_or(term, trunc), dtype=torch.float32, device=device)
        with torch.no_grad():
            next_value = get_action_and_value(next_obs)[3]
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(num_steps)):
                nextnonterminal = 1.0 - (next_done if t == num_steps - 1 else dones[t + 1])
                nextvalues = next_value if t == num_steps - 1 else values[t + 1]
                delta = rewards[t] + 0.99 * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + 0.99 * 0.95 * nextnonterminal * lastgaelam
            returns = advantages + values
        b_obs, b_actions, b_logprobs = obs.reshape(-1, 4, 84, 84), actions.reshape(-1), logprobs.reshape(-1)
        b_adv, b_returns, b_values = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)
        for _ in range(4):
            perm = np.random.permutation(batch)
            for s in range(0, batch, minibatch):
                mb = perm[s : s + minibatch]
                _, newlogprob, entropy, newvalue = get_action_and_value(b_obs[mb], b_actions[mb])
                ratio = (newlogprob - b_logprobs[mb]).exp()
                adv = (b_adv[mb] - b_adv[mb].mean()) / (b_adv[mb].std() + 1e-8)
                pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(0.9, 1.1)).mean()
                v_clipped = b_values[mb] + (newvalue - b_values[mb]).clamp(-0.1, 0.1)
                v_loss = 0.5 * torch.max((newvalue - b_returns[mb]) ** 2, (v_clipped - b_returns[mb]) ** 2).mean()
                loss = pg_loss - 0.01 * entropy.mean() + 0.5 * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                optimizer.step()
    sps = global_step / (time.perf_counter() - start)
    envs.close()
    return sps


def main() -> None:
    bench = tyro.cli(BenchArgs)
    torch.set_num_threads(cores())
    dev = torch.device(bench.device).type
    default_layout = ours.Args().channels_last
    other_layout = "--no-channels-last" if default_layout else "--channels-last"
    fast_bf16 = ours.has_fast_bf16(bench.device)
    bf16_note = "" if fast_bf16 else " (refused by the script here: no bf16 hardware)"
    configs = {
        "CleanRL-style baseline (sync)": None,
        f"ppo_atari_envpool.py, defaults ({'channels-last' if default_layout else 'no channels-last'})": {},
        "ppo_atari_envpool.py --async-envs": {"async_envs": True},
        f"ppo_atari_envpool.py {other_layout}": {"channels_last": not default_layout},
    }
    if not bench.skip_bf16:  # train() directly: these rows run even where the script refuses --bf16
        configs[f"ppo_atari_envpool.py --bf16{bf16_note}"] = {"bf16": True}
        configs[f"ppo_atari_envpool.py --bf16 --async-envs{bf16_note}"] = {"bf16": True, "async_envs": True}
    sps = {name: [] for name in configs}
    for _ in range(bench.repeats):
        for name, overrides in configs.items():
            with redirect_stdout(io.StringIO()):  # the script's result line: the benchmark prints its own
                sps[name].append(cleanrl_baseline(bench) if overrides is None else run_ours(bench, **overrides))
            print(f"  {name}: {sps[name][-1]:,.0f} SPS", file=sys.stderr, flush=True)
    base = statistics.median(sps["CleanRL-style baseline (sync)"])
    setting = (
        f"{bench.num_envs} envs x {bench.num_steps} steps, 4 minibatches x 4 epochs, {bench.iterations} iterations"
    )
    print(f"\n`python {' '.join(sys.argv)}` on {machine(envpool)}; {bench.env_id}, {setting}, device {dev}\n")
    print(
        "| training loop | SPS"
        + (f", median of {bench.repeats} (range)" if bench.repeats > 1 else "")
        + " | vs baseline |"
    )
    print("|---|---|---|")
    for name, values in sps.items():
        spread = f" ({min(values):,.0f}–{max(values):,.0f})" if len(values) > 1 else ""
        print(f"| {name} | {statistics.median(values):,.0f}{spread} | {statistics.median(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
