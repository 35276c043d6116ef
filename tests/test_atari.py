"""ppo_atari_envpool.py: game statistics, the video grid, the network, the rollout bookkeeping under
EnvPool's auto-reset and async ordering (with a scripted fake pool), PPO's ratio at the start of every
update, the evaluation of whole games, and short real runs."""

import glob
import os
import types

import imageio_ffmpeg
import numpy as np
import pytest
import torch

import ppo_atari_envpool as A
from conftest import SUMMARY_KEYS, assert_one_error_line, call_main, read_json, run_script


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
    games = [
        g for raw, over, n in script for g in stats.update(np.array([0, 1]), np.array(raw), np.array(over), np.array(n))
    ]
    assert games == [(3.0, 4), (12.0, 4), (5.0, 2)]
    assert stats.scores.tolist() == [2.0, 0.0]  # env 0's new game has scored 2 so far


def test_game_stats_follow_env_ids_in_any_order():
    stats = A.GameStats(4)
    assert stats.update(np.array([3, 1]), np.array([1.0, 2.0]), np.array([False, False]), np.array([1, 1])) == []
    assert stats.update(np.array([1, 3]), np.array([10.0, 20.0]), np.array([True, False]), np.array([2, 2])) == [
        (12.0, 2)
    ]
    assert stats.scores.tolist() == [0.0, 0.0, 0.0, 21.0]


# ---------------------------------------------------------------------------------------------
# Video grid
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, rows, cols", [(1, 1, 1), (2, 1, 2), (5, 2, 3), (8, 2, 4), (9, 3, 3), (16, 4, 4), (20, 4, 4)]
)
def test_video_grid_fits_the_envs(n, rows, cols):
    """Up to 16 envs, as square as fits them: 8 envs make a 2x4 grid, not a 4x4 one with 8 black tiles."""
    obs = torch.zeros((3, n, 4, 84, 84), dtype=torch.uint8)
    obs[:, :, -1] = 10 * (torch.arange(n, dtype=torch.uint8) + 1).view(1, n, 1, 1)  # the newest frame is shown
    frames = A.grid_video(obs)
    assert frames.shape == (3, rows * 84, cols * 84, 3) and frames.dtype == np.uint8
    centres = frames[:, 42::84, 42::84, 0]  # the middle pixel of every tile, row by row
    shown = min(n, 16)
    expected = [10 * (i + 1) for i in range(shown)] + [0] * (rows * cols - shown)  # black tiles fill the last row
    assert (centres == np.array(expected).reshape(rows, cols)).all()


# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("channels_last", [False, True])
def test_network_shapes_and_dtypes(channels_last):
    torch.manual_seed(0)
    agent = A.Agent(6, channels_last=channels_last)
    obs = torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8)
    logits, value = agent(obs)
    assert logits.shape == (5, 6) and value.shape == (5,) and logits.dtype == value.dtype == torch.float32
    action, logprob, value2 = agent.get_action(obs)
    assert action.dtype == torch.long and action.shape == (5,) and ((0 <= action) & (action < 6)).all()
    assert (logprob <= 0).all()
    torch.testing.assert_close(value2, value)
    newlogprob, entropy, value3 = agent.evaluate(obs, action)
    torch.testing.assert_close(newlogprob, logprob)
    assert ((0 < entropy) & (entropy <= np.log(6) + 1e-5)).all()
    greedy, greedy_logprob, _ = agent.get_action(obs, greedy=True)
    assert (greedy == logits.argmax(-1)).all() and (
        greedy_logprob >= logits.log_softmax(-1).max(-1).values - 1e-6
    ).all()
    # the memory layout does not change the result
    plain = A.Agent(6)
    plain.load_state_dict(agent.state_dict())
    torch.testing.assert_close(plain(obs)[0], logits, atol=1e-5, rtol=1e-5)
    assert agent.network[0].weight.is_contiguous(memory_format=torch.channels_last) == channels_last
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


@pytest.mark.parametrize("fast", [False, True])
def test_bf16_is_refused_without_bf16_hardware(fast, monkeypatch, capsys):
    """Emulated bf16 ran 6.5x slower on an AVX2 EPYC: without the hardware --bf16 is one error line."""
    monkeypatch.setattr(A, "has_fast_bf16", lambda device: fast)
    if fast:
        assert A.Args(bf16=True, device="cpu").bf16
    else:
        with pytest.raises(ValueError, match="--bf16 must be off here: no bfloat16 hardware"):
            A.Args(bf16=True, device="cpu")


def test_bf16_hardware_check_follows_torch_cpuinfo():
    expected = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert A.has_fast_bf16("cpu") == expected


# ---------------------------------------------------------------------------------------------
# Rollout bookkeeping with a fake EnvPool
# ---------------------------------------------------------------------------------------------
class FakePool:
    """EnvPool's gymnasium API and auto-reset, scripted: env e's k-th real step earns raw reward
    1000*e + k, and every `period`-th step ends its episode; the step after a done is a reset step
    (reward 0, action ignored). Env e's n-th observation (n = 0 after the reset) is filled with the value
    (n + 50*e) % 256, so a stored frame names its env and place. recv() hands back `batch_size` ready
    envs, roughly first-come first-served but shuffled, as EnvPool's thread pool does. `sent[e]` lists
    the actions env e was given, in order."""

    def __init__(self, num_envs, batch_size, seed, period=7):
        self.num_envs, self.batch_size, self.period = num_envs, batch_size, period
        self.single_action_space = types.SimpleNamespace(n=4)
        self.rng = np.random.default_rng(seed)
        self.steps = np.zeros(num_envs, dtype=np.int64)
        self.after_done = np.zeros(num_envs, dtype=bool)
        self.sent = {e: [] for e in range(num_envs)}
        self.ready = []  # (env, raw reward, terminated, observation value)

    def async_reset(self):
        self.ready = [(e, 0.0, False, 50 * e % 256) for e in range(self.num_envs)]

    def send(self, actions, env_ids):
        assert len(actions) == len(env_ids) and actions.dtype == np.int64
        assert not {e for e, *_ in self.ready} & set(env_ids.tolist()), "an env got an action while still in flight"
        for e, a in zip(env_ids, actions):
            self.sent[e].append(int(a))
            obs = (len(self.sent[e]) + 50 * e) % 256
            if self.after_done[e]:
                self.after_done[e] = False
                self.ready.append((e, 0.0, False, obs))
            else:
                self.steps[e] += 1
                done = self.steps[e] % self.period == 0
                self.after_done[e] = done
                self.ready.append((e, float(1000 * e + self.steps[e]), bool(done), obs))

    def recv(self):
        assert len(self.ready) >= self.batch_size, "EnvPool would wait here forever: too few envs in flight"
        window = min(len(self.ready), self.batch_size + 2)
        picks = sorted(self.rng.choice(window, size=self.batch_size, replace=False), reverse=True)
        batch = [self.ready.pop(i) for i in picks]
        ids = np.array([e for e, *_ in batch], dtype=np.int32)
        raw = np.array([r for _, r, _, _ in batch], dtype=np.float32)
        term = np.array([t for _, _, t, _ in batch])
        obs = np.array([o for *_, o in batch], dtype=np.uint8).reshape(-1, 1, 1, 1) * np.ones((1, 4, 84, 84), np.uint8)
        info = {"env_id": ids, "reward": raw, "terminated": term.astype(np.int32), "elapsed_step": self.steps[ids]}
        # the training reward is left unclipped here, so every row's reward names its env and step
        return obs, raw, term, np.zeros_like(term), info

    def close(self):
        pass


def fake_make_env(period):
    return lambda env_id, n, seed, batch_size=None: FakePool(n, batch_size or n, seed, period)


@pytest.mark.parametrize("async_envs", [False, True])
def test_collect_rollout_fills_each_envs_column_in_order_and_parks_in_async_mode(async_envs):
    num_envs, num_steps, period, rollouts = 6, 8, 5, 5
    env_batch = num_envs // 2 if async_envs else num_envs
    envs = FakePool(num_envs, env_batch, seed=3, period=period)
    torch.manual_seed(0)
    agent = A.Agent(4)
    rollout = A.Rollout.empty(num_steps, num_envs, torch.device("cpu"))
    envs.async_reset()
    columns = {e: [] for e in range(num_envs)}  # every env's trained rows, rollout after rollout
    env_steps, ever_parked = 0, 0
    for _ in range(rollouts):
        env_steps += A.collect_rollout(agent, envs, rollout, env_batch)
        assert (num_steps + 1 <= rollout.filled).all() and (rollout.filled <= 2 * num_steps + 1).all()
        parked, in_flight = set(np.flatnonzero(rollout.parked).tolist()), {e for e, *_ in envs.ready}
        # a parked env's last action waits for the next rollout, and EnvPool can still fill its next batch
        assert not parked & in_flight and len(in_flight) >= env_batch and len(parked) <= num_envs - env_batch
        # every filled row's action was sent to its env, but for a parked env's last row
        assert all(len(envs.sent[e]) == len(columns[e]) + rollout.filled[e] - (e in parked) for e in range(num_envs))
        ever_parked += len(parked)
        for e in range(num_envs):
            columns[e] += [
                (int(rollout.obs[t, e, 0, 0, 0]), int(rollout.actions[t, e]), float(rollout.rewards[t, e]),
                 bool(rollout.terminated[t, e]), bool(rollout.dones[t, e]), bool(rollout.valid[t, e]))
                for t in range(num_steps)
            ]  # fmt: skip
    assert (ever_parked > 0) == async_envs
    for e, rows in columns.items():
        # the env's observations in its own order, none lost or repeated, and the actions it was given
        assert [obs for obs, *_ in rows] == [(n + 50 * e) % 256 for n in range(len(rows))]
        assert envs.sent[e][: len(rows)] == [action for _, action, *_ in rows]
        k, after_done = 0, False
        for _, _, reward, terminated, done, valid in rows:
            if after_done:  # the reset step: reward 0, not a done, masked out of the loss
                assert reward == 0 and not done and not valid
            else:  # the reward in this row is the one for this row's action (it came with the next observation)
                k += 1
                assert reward == 1000 * e + k and done == terminated == (k % period == 0) and valid
            after_done = done
    # each env's first row is its reset observation; every later row is one emulated step
    assert env_steps == sum(rollouts * num_steps - num_steps + rollout.filled[e] - 1 for e in range(num_envs))


@pytest.mark.parametrize("async_envs", [False, True])
def test_rollout_keeps_each_envs_steps_in_order_and_masks_reset_steps(async_envs, in_tmp, monkeypatch):
    num_envs, num_steps, period = 6, 16, 7
    monkeypatch.setattr(A, "make_env", fake_make_env(period))
    monkeypatch.setattr(A, "atari_game_rule", lambda env_id: (True, ""))
    rollouts, samples = [], []
    real_gae, real_loss = A.compute_gae, A.ppo_loss

    def recorded_gae(rewards, values, next_values, terminated, dones, *rest):
        rollouts.append((rewards.clone(), terminated.clone(), dones.clone()))
        return real_gae(rewards, values, next_values, terminated, dones, *rest)

    def recorded_loss(agent, args, batch):  # every minibatch of one size; the reset steps in it weigh 0
        assert len(batch.obs) == num_envs * num_steps // 2
        samples.append(int(batch.mask.sum()))
        return real_loss(agent, args, batch)

    monkeypatch.setattr(A, "compute_gae", recorded_gae)
    monkeypatch.setattr(A, "ppo_loss", recorded_loss)
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
        # and the reset steps are not trained on: the rows the loss weighs are the valid ones
    assert sum(samples) == valid_rows
    summary = read_json(glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))[0])
    assert summary["episodes"] > 0 and summary["status"] == "completed"
    # scores are raw rewards summed over a game: env e's game j is steps 7j+1..7j+7
    assert summary["mean_return_last_100"] > 1000


@pytest.mark.parametrize("norm_adv, clip_vloss", [(True, True), (False, False)])
def test_the_masked_loss_is_the_loss_of_the_kept_rows_alone(norm_adv, clip_vloss):
    """The batch keeps the reset steps with mask 0, so that it has one size (a CUDA graph can hold the update): loss,
    statistics and gradient must be those of the kept rows alone, whatever the masked rows hold."""
    torch.manual_seed(0)
    agent, n = A.Agent(4), 12
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    batch = A.Batch(torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8), torch.randint(0, 4, (n,)),
                    torch.randn(n) - 1.4, torch.randn(n), torch.randn(n), torch.randn(n), mask)  # fmt: skip
    junk = (mask == 0).float()
    masked = A.Batch(*(x if i < 2 else x + 1e3 * junk for i, x in enumerate(batch[:6])), mask)  # junk where masked
    kept = A.Batch(*(x[mask.bool()] for x in batch[:6]), torch.ones(int(mask.sum())))
    args = A.Args(norm_adv=norm_adv, clip_vloss=clip_vloss, device="cpu")
    results = []
    for b in (masked, kept):
        agent.zero_grad()
        loss, stats = A.ppo_loss(agent, args, b)
        loss.backward()
        results.append((stats, [p.grad.clone() for p in agent.parameters()]))
    (stats, grads), (stats_kept, grads_kept) = results
    for tag in stats:
        torch.testing.assert_close(stats[tag], stats_kept[tag], msg=tag)
    for g, g_kept in zip(grads, grads_kept):
        torch.testing.assert_close(g, g_kept)
    with torch.no_grad():  # and those are CleanRL's, on plain means and torch's std
        logprob, entropy, value = agent.evaluate(kept.obs, kept.actions)
        ratio, adv = (logprob - kept.logprobs).exp(), kept.advantages
        adv = (adv - adv.mean()) / (adv.std() + 1e-8) if norm_adv else adv
        pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    torch.testing.assert_close(stats["losses/policy_loss"], pg_loss)
    torch.testing.assert_close(stats["losses/entropy"], entropy.mean())
    if not clip_vloss:
        torch.testing.assert_close(stats["losses/value_loss"], 0.5 * (value - kept.returns).square().mean())
    ev = A.explained_variance(masked.values, masked.returns, mask)
    torch.testing.assert_close(ev, 1 - (kept.returns - kept.values).var() / kept.returns.var())


@pytest.mark.parametrize("async_envs", [False, True])
def test_every_trained_row_starts_the_update_at_ratio_one(async_envs, in_tmp, monkeypatch):
    """Row T of a rollout is the next one's row 0, and in async mode parked envs and envs that ran ahead
    carry more rows over: all were acted on before the update in between. Their stored log-probs must be
    the policy's at the start of the next update, like every other row's (the PPO ratio starts at 1)."""
    monkeypatch.setattr(A, "make_env", fake_make_env(period=5))
    monkeypatch.setattr(A, "atari_game_rule", lambda env_id: (True, ""))
    real_loss, calls, stale, rows = A.ppo_loss, [0], [], []

    def checked_loss(agent, args, batch):
        if calls[0] % args.update_epochs == 0:  # an update's first step (one minibatch an epoch): the policy is π_old
            with torch.no_grad():
                now = agent.evaluate(batch.obs, batch.actions)[0]
            stale.append(int(((now - batch.logprobs).abs() > 1e-5).sum()))
            rows.append(len(batch.obs))
        calls[0] += 1
        return real_loss(agent, args, batch)

    monkeypatch.setattr(A, "ppo_loss", checked_loss)
    args = A.Args(env_id="Fake-v5", num_envs=6, num_steps=8, total_timesteps=6 * 8 * 10, num_minibatches=1,
                  update_epochs=2, learning_rate=1e-3, anneal_lr=False, async_envs=async_envs, eval_episodes=0,
                  progress_bar=False, device="cpu", channels_last=False)  # fmt: skip
    A.train(args)
    assert len(rows) == 10
    assert sum(stale) == 0, f"{sum(stale)} of {sum(rows)} trained rows had a stale log-prob (per update: {stale})"


# ---------------------------------------------------------------------------------------------
# Evaluation with real EnvPool
# ---------------------------------------------------------------------------------------------
class CountingPool:
    """A real pool that counts its steps and records the actions it was given."""

    def __init__(self, envs):
        self.envs, self.steps, self.actions = envs, 0, set()

    def __getattr__(self, name):
        return getattr(self.envs, name)

    def step(self, actions, env_ids=None):
        self.steps += 1
        self.actions |= set(actions.tolist())
        return self.envs.step(actions, env_ids)


def test_evaluation_games_end_without_the_agent_pressing_fire(monkeypatch):
    """The agent never learned to press FIRE after a lost life (EnvPool's episodic-life reset did it in
    training). Without life loss, Breakout waits for FIRE until the 27000-step limit; evaluated as in
    training, a never-FIRE policy loses its 5 lives within a few hundred steps, and the game's score is
    counted over all of them."""
    torch.manual_seed(0)
    agent = A.Agent(4)
    with torch.no_grad():
        agent.actor.bias[1] = -1e9  # Breakout's actions: NOOP, FIRE, RIGHT, LEFT
    pools = []
    real_make_env = A.make_env
    monkeypatch.setattr(A, "make_env", lambda *a, **k: pools.append(CountingPool(real_make_env(*a, **k))) or pools[-1])
    scores = A.evaluate(agent, None, A.Args(env_id="Breakout-v5", eval_episodes=2, device="cpu"), video=None)
    (pool,) = pools
    assert 1 not in pool.actions and pool.steps < 2000, pool.steps  # 27000 if a game stalled
    assert len(scores) == 2 and all(s >= 0 and s == int(s) for s in scores)


# ---------------------------------------------------------------------------------------------
# Real EnvPool runs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env_id, flags",
    [
        # slow: CI runs Breakout's defaults (synchronous envs) in test_layout's recorded scalars, its evaluation in
        # the never-FIRE test above, and the command line and summary here with Pong
        pytest.param("Breakout-v5", [], marks=pytest.mark.slow),
        ("Pong-v5", ["--async-envs", "--capture-video", "--video-interval", "2", "--save-model"]),
    ],
)
def test_smoke_run_on_a_real_game(env_id, flags, tmp_path):
    flags = ["--env-id", env_id, "--num-envs", "8", "--num-steps", "32", "--total-timesteps", "1024",
             "--eval-episodes", "1", "--no-progress-bar", *flags]  # fmt: skip
    result = run_script("ppo_atari_envpool", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = glob.glob(str(tmp_path / "runs" / f"{env_id}__ppo_atari_envpool__1__*"))
    summary = read_json(os.path.join(run_dir, "summary.json"))
    assert set(summary) == SUMMARY_KEYS and summary["args"]["async_envs"] == ("--async-envs" in flags)
    assert summary["status"] == "completed" and summary["total_env_steps"] >= 1024 and summary["mean_sps"] > 0
    assert summary["iterations"] == 4 and len(summary["eval_returns"]) == 1
    assert glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    if "--capture-video" in flags:
        videos = sorted(os.listdir(os.path.join(run_dir, "videos")))
        assert videos == ["evaluation.mp4", "training_iter00001.mp4", "training_iter00003.mp4"]
        # the evaluation film shows the whole game, one frame per agent step
        frames = imageio_ffmpeg.count_frames_and_secs(os.path.join(run_dir, "videos", "evaluation.mp4"))[0]
        assert frames > 700  # a game of Pong lost 0:21 lasts more than 700 agent steps
        A.Agent(6).load_state_dict(torch.load(os.path.join(tmp_path, summary["model_path"])))


@pytest.mark.parametrize(
    "flags, hide, message",
    [
        (["--env-id", "Foo-v5"], None, "--env-id must be an EnvPool Atari game"),
        (
            ["--env-id", "CartPole-v1"],
            None,
            "--env-id must be an EnvPool Atari game (e.g. Pong-v5), got CartPole",
        ),
        (["--env-id", "Breakot-v5"], None, "--env-id must be an EnvPool Atari game (did you mean Breakout-v5?)"),
        (["--num-envs", "0"], None, "--num-envs must be positive"),
        (["--async-envs", "--num-envs", "1"], None, "--num-envs must be positive (--async-envs: at least 2), got 1"),
        (["--video-interval", "-1"], None, "--video-interval must be >= 0"),
        ([], "envpool", "needs envpool: pip install envpool==1.2.5"),
    ],
)
def test_bad_input_gives_one_clear_line_before_anything_is_built(flags, hide, message, tmp_path):
    if hide:  # a fresh interpreter, without the package
        result = run_script("ppo_atari_envpool", *flags, cwd=tmp_path, timeout=120, hide=hide)
    else:
        result = call_main("ppo_atari_envpool", *flags, cwd=tmp_path)
    assert_one_error_line(result, message)
    assert not os.path.exists(tmp_path / "runs")
