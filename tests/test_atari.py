"""ppo_atari_envpool.py: game statistics, the network, the rollout bookkeeping under EnvPool's
auto-reset and async ordering (with a scripted fake pool), and short real runs."""

import glob
import json
import os
import types

import numpy as np
import pytest
import torch

import ppo_atari_envpool as A
from conftest import assert_one_error_line, run_script


# ---------------------------------------------------------------------------------------------
# GameStats against a scripted game
# ---------------------------------------------------------------------------------------------
def test_game_score_is_the_raw_reward_summed_over_all_lives():
    """Two envs. Env 0 loses lives mid-game (episodic-life 'terminated' without game over) and
    scores raw rewards 4 and 7 (clipped to 1 for training); env 1 is cut by the step limit."""
    stats = A.GameStats(2)
    # per step: (raw rewards, game over, elapsed steps); the script of both envs side by side
    script = [
        ([4.0, 1.0], [False, False], [1, 1]),
        ([0.0, 0.0], [False, False], [2, 2]),  # env 0 loses a life here: not a game over
        ([0.0, 0.0], [False, False], [2, 3]),  # the reset step after the lost life: reward 0
        ([7.0, 2.0], [False, True], [3, 4]),  # env 1 truncated: its game ends with score 3
        ([1.0, 0.0], [True, False], [4, 0]),  # env 0 loses its last life: score 12; env 1's reset step
        ([0.0, 5.0], [False, False], [0, 1]),
        ([2.0, 0.0], [False, True], [1, 2]),
    ]
    games = [g for raw, over, n in script for g in stats.update(np.array([0, 1]), np.array(raw), np.array(over), np.array(n))]
    assert games == [(3.0, 4), (12.0, 4), (5.0, 2)]
    assert stats.scores.tolist() == [2.0, 0.0]  # env 0's new game has scored 2 so far


def test_game_stats_follow_env_ids_in_any_order():
    stats = A.GameStats(4)
    assert stats.update(np.array([3, 1]), np.array([1.0, 2.0]), np.array([False, False]), np.array([1, 1])) == []
    assert stats.update(np.array([1, 3]), np.array([10.0, 20.0]), np.array([True, False]), np.array([2, 2])) == [(12.0, 2)]
    assert stats.scores.tolist() == [0.0, 0.0, 0.0, 21.0]


# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("channels_last", [False, True])
def test_network_shapes_and_dtypes(channels_last):
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    agent = A.Agent(6).to(memory_format=fmt)
    obs = torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8).contiguous(memory_format=fmt)
    logits, value = agent(obs)
    assert logits.shape == (5, 6) and value.shape == (5,) and logits.dtype == value.dtype == torch.float32
    action, logprob, value2 = agent.act(obs)
    assert action.dtype == torch.long and action.shape == (5,) and ((0 <= action) & (action < 6)).all()
    assert (logprob <= 0).all()
    torch.testing.assert_close(value2, value)
    newlogprob, entropy, value3 = agent.evaluate(obs, action)
    torch.testing.assert_close(newlogprob, logprob)
    assert ((0 < entropy) & (entropy <= np.log(6) + 1e-5)).all()
    # the memory layout does not change the result
    plain = A.Agent(6)
    plain.load_state_dict(agent.state_dict())
    torch.testing.assert_close(plain(obs.contiguous())[0], logits, atol=1e-5, rtol=1e-5)
    # the Nature CNN's trunk: conv 8x8x4->32, 4x4x32->64, 3x3x64->64, then 3136->512, with biases
    assert sum(p.numel() for p in agent.network.parameters()) == 8_224 + 32_832 + 36_928 + 1_606_144


def test_bf16_trunk_is_close_to_float32_and_heads_stay_float32():
    torch.manual_seed(0)
    agent = A.Agent(4)
    fast = A.Agent(4, bf16=True)
    fast.load_state_dict(agent.state_dict())
    obs = torch.randint(0, 256, (16, 4, 84, 84), dtype=torch.uint8)
    logits, value = agent(obs)
    logits16, value16 = fast(obs)
    assert logits16.dtype == value16.dtype == torch.float32
    torch.testing.assert_close(logits16, logits, atol=2e-3, rtol=0.05)
    torch.testing.assert_close(value16, value, atol=0.05, rtol=0.05)
    assert all(p.dtype == torch.float32 for p in fast.parameters())


# ---------------------------------------------------------------------------------------------
# Rollout bookkeeping with a fake EnvPool
# ---------------------------------------------------------------------------------------------
class FakePool:
    """EnvPool's gymnasium API and auto-reset, scripted: env e's k-th real step earns raw reward
    1000*e + k, and every `period`-th step ends its episode; the step after a done is a reset step
    (reward 0, action ignored). recv() hands back `batch_size` ready envs, roughly first-come
    first-served but shuffled, as EnvPool's thread pool does."""

    def __init__(self, num_envs, batch_size, seed, period=7):
        self.num_envs, self.batch_size, self.period = num_envs, batch_size, period
        self.single_action_space = types.SimpleNamespace(n=4)
        self.rng = np.random.default_rng(seed)
        self.steps = np.zeros(num_envs, dtype=np.int64)
        self.after_done = np.zeros(num_envs, dtype=bool)
        self.ready = []  # (env, raw reward, terminated)

    def async_reset(self):
        self.ready = [(e, 0.0, False) for e in range(self.num_envs)]

    def send(self, actions, env_ids):
        assert len(actions) == len(env_ids) and actions.dtype == np.int64
        for e in env_ids:
            if self.after_done[e]:
                self.after_done[e] = False
                self.ready.append((e, 0.0, False))
            else:
                self.steps[e] += 1
                done = self.steps[e] % self.period == 0
                self.after_done[e] = done
                self.ready.append((e, float(1000 * e + self.steps[e]), bool(done)))

    def recv(self):
        assert len(self.ready) >= self.batch_size, "EnvPool would wait here forever: too few envs in flight"
        window = min(len(self.ready), self.batch_size + 2)
        picks = sorted(self.rng.choice(window, size=self.batch_size, replace=False), reverse=True)
        batch = [self.ready.pop(i) for i in picks]
        ids = np.array([e for e, _, _ in batch], dtype=np.int32)
        raw = np.array([r for _, r, _ in batch], dtype=np.float32)
        term = np.array([t for _, _, t in batch])
        info = {"env_id": ids, "reward": raw, "terminated": term.astype(np.int32), "elapsed_step": self.steps[ids]}
        # the training reward is left unclipped here, so every row's reward names its env and step
        return np.zeros((len(ids), 4, 84, 84), np.uint8), raw, term, np.zeros_like(term), info

    def close(self):
        pass


@pytest.mark.parametrize("async_envs", [False, True])
def test_rollout_keeps_each_envs_steps_in_order_and_masks_reset_steps(async_envs, in_tmp, monkeypatch):
    num_envs, num_steps, period = 6, 16, 7
    monkeypatch.setattr(A, "make_env", lambda env_id, n, seed, batch_size=None, train=True: FakePool(n, batch_size, seed, period))
    rollouts, samples = [], []
    real_gae, real_loss = A.compute_gae, A.ppo_loss
    monkeypatch.setattr(A, "compute_gae", lambda r, v, nv, term, d, g, l: rollouts.append((r.clone(), term.clone(), d.clone())) or real_gae(r, v, nv, term, d, g, l))
    monkeypatch.setattr(A, "ppo_loss", lambda agent, args, obs, *rest: samples.append(len(obs)) or real_loss(agent, args, obs, *rest))
    args = A.Args(env_id="Fake-v5", num_envs=num_envs, num_steps=num_steps, total_timesteps=num_envs * num_steps * 12,
                  num_minibatches=2, update_epochs=1, async_envs=async_envs, eval_episodes=0, progress_bar=False,
                  device="cpu", channels_last=False)  # fmt: skip
    A.train(args)
    assert len(rollouts) == 12
    next_k = {e: 1 for e in range(num_envs)}  # the next real step each env should show
    valid_rows = 0
    for rewards, terminated, dones in rollouts:
        assert rewards.shape == (num_steps, num_envs)
        for e in range(num_envs):
            after_done = False
            for t in range(num_steps):
                if after_done:  # the reset step: reward 0, not a done, left out of the loss
                    assert rewards[t, e] == 0 and not dones[t, e]
                else:
                    k = next_k[e]
                    # the reward in this row is the one for this row's action (shifted from the next recv)
                    assert rewards[t, e] == 1000 * e + k
                    assert bool(dones[t, e]) == bool(terminated[t, e]) == (k % period == 0)
                    next_k[e] += 1
                    valid_rows += 1
                after_done = bool(dones[t, e])
        # and the reset steps are not trained on: every sample in this update is a valid row
    assert sum(samples) == valid_rows
    summary = json.load(open(glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))[0]))
    assert summary["games"] > 0 and summary["status"] == "completed"
    # scores are raw rewards summed over a game: env e's game j is steps 7j+1..7j+7
    assert summary["mean_return_last_100"] > 1000


# ---------------------------------------------------------------------------------------------
# Real EnvPool runs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("env_id, flags", [("Breakout-v5", []), ("Pong-v5", ["--async-envs", "--capture-video", "--video-interval", "2", "--save-model"])])
def test_smoke_run_on_a_real_game(env_id, flags, tmp_path):
    result = run_script("ppo_atari_envpool", "--env-id", env_id, "--num-envs", "8", "--num-steps", "32", "--total-timesteps", "1024",
                     "--eval-episodes", "1", "--no-progress-bar", *flags, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (run_dir,) = glob.glob(str(tmp_path / "runs" / f"{env_id}__ppo_atari_envpool__1__*"))
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["status"] == "completed" and summary["total_env_steps"] >= 1024 and summary["mean_sps"] > 0
    assert len(summary["eval_returns"]) == 1
    assert glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    if "--capture-video" in flags:
        assert sorted(os.listdir(os.path.join(run_dir, "videos"))) == ["rollout_iter00001.mp4", "rollout_iter00003.mp4"]
        A.Agent(6).load_state_dict(torch.load(os.path.join(tmp_path, summary["model_path"])))


@pytest.mark.parametrize(
    "flags, hide, message",
    [
        (["--env-id", "Foo-v5"], None, "unknown --env-id 'Foo-v5'"),
        (["--num-envs", "0"], None, "--num-envs must be positive"),
        (["--async-envs", "--num-envs", "1"], None, "--async-envs needs --num-envs >= 2"),
        ([], "envpool", "needs envpool: pip install envpool==1.2.5"),
    ],
)
def test_bad_input_gives_one_clear_line(flags, hide, message, tmp_path):
    assert_one_error_line(run_script("ppo_atari_envpool", *flags, cwd=tmp_path, timeout=120, hide=hide), message)
