"""The tensor CartPole against gymnasium's reference CartPole-v1."""

import importlib
import io
import math

import gymnasium as gym
import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

from conftest import SCRIPTS

pytestmark = pytest.mark.quick  # in the two-minute run: python -m pytest -m quick


@pytest.fixture(params=SCRIPTS)
def P(request):
    """Each script carries its own copy of the env: every copy is checked."""
    return importlib.import_module(request.param)


def random_states(n: int, seed: int) -> np.ndarray:
    """States around and beyond the termination bounds, as float32."""
    rng = np.random.default_rng(seed)
    high = np.array([2.6, 3.0, 0.25, 3.5])
    return rng.uniform(-high, high, size=(n, 4)).astype(np.float32)


def test_constants_match_gymnasium(P):
    ref = CartPoleEnv()
    for name in ("gravity", "masscart", "masspole", "total_mass", "length", "polemass_length", "force_mag", "tau",
                 "x_threshold", "theta_threshold_radians"):  # fmt: skip
        assert getattr(P.CartPole, name) == pytest.approx(getattr(ref, name), rel=1e-12), name
    assert ref.kinematics_integrator == "euler"
    assert gym.make("CartPole-v1").spec.max_episode_steps == P.CartPole.max_episode_steps == 500


@pytest.mark.parametrize("seed", [0, 1])
def test_one_step_matches_gymnasium(P, seed):
    n = 2000
    states = random_states(n, seed)
    actions = np.random.default_rng(seed + 100).integers(0, 2, size=n)
    env = P.CartPole(n, "cpu", seed=0)
    env.reset()
    env.state = torch.from_numpy(states)
    _, reward, terminated, truncated, info = env.step(torch.from_numpy(actions))

    ref = CartPoleEnv()
    ref.reset(seed=0)
    ref_obs, ref_term = np.empty((n, 4), np.float32), np.empty(n, bool)
    for i in range(n):
        ref.state = states[i].astype(np.float64)
        ref.steps_beyond_terminated = None
        ref_obs[i], r, ref_term[i], ref_trunc, _ = ref.step(int(actions[i]))
        assert r == 1.0 and not ref_trunc
    np.testing.assert_allclose(info["final_obs"].numpy(), ref_obs, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(terminated.numpy(), ref_term)
    assert 0.2 < ref_term.mean() < 0.8  # both kinds of transitions are covered
    assert torch.all(reward == 1.0) and not truncated.any()


def test_trajectory_matches_gymnasium(P):
    """A whole episode, stepping both envs with the same actions, stays within float32 error."""
    env = P.CartPole(1, "cpu", seed=3)
    obs, _ = env.reset()
    ref = CartPoleEnv()
    ref.reset(seed=0)
    ref.state = obs[0].double().numpy()
    rng = np.random.default_rng(0)
    for steps in range(1, 501):  # noqa: B007 (read after the loop)
        a = int(rng.integers(0, 2))
        obs, _, terminated, _, info = env.step(torch.tensor([a]))
        ref_obs, _, ref_term, _, _ = ref.step(a)
        np.testing.assert_allclose(info["final_obs"][0].numpy(), ref_obs, atol=1e-5, rtol=0)
        assert bool(terminated[0]) == ref_term
        if ref_term:
            break
    assert steps > 6


def test_truncation_at_500_steps_and_autoreset(P):
    env = P.CartPole(3, "cpu", seed=0)
    env.reset()
    for t in range(1, 501):
        # hold the poles upright so only the time limit can end the episode
        env.state = torch.zeros(3, 4)
        obs, reward, terminated, truncated, info = env.step(torch.tensor([0, 1, 0]))
        assert not terminated.any()
        if t < 500:
            assert not truncated.any()
    assert truncated.all()
    assert torch.all(info["episode_length"] == 500) and torch.all(info["episode_return"] == 500.0)
    # the real last observation is kept; the returned observation is a fresh initial state
    assert torch.all(info["final_obs"][:, 1] != 0.0)
    assert torch.all(obs.abs() <= 0.05) and not torch.equal(obs, info["final_obs"])
    assert torch.all(env.episode_length == 0) and torch.all(env.episode_return == 0)


@pytest.mark.parametrize("sync_free", [False, True], ids=["cpu-reset", "gpu-style-reset"])
def test_termination_resets_only_finished_envs(P, sync_free):
    env = P.CartPole(2, "cpu", seed=0)
    env.sync_free_reset = sync_free  # the GPU's where-based reset, exercised on the CPU
    env.reset()
    env.state = torch.tensor([[2.39, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    obs, _, terminated, truncated, info = env.step(torch.tensor([1, 1]))
    assert terminated.tolist() == [True, False] and not truncated.any()
    assert info["final_obs"][0, 0] > 2.4 and obs[0].abs().max() <= 0.05
    torch.testing.assert_close(obs[1], info["final_obs"][1])
    assert env.episode_length.tolist() == [0, 1]


def test_seeding(P):
    a, b, c = (P.CartPole(8, "cpu", seed=s).reset()[0] for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.abs().max() <= 0.05 and a.dtype == torch.float32


def checkpointed(state: dict) -> dict:
    """`state` through torch.save and a weights-only torch.load, as a checkpoint goes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_resumed_env_goes_on_with_the_same_random_stream(P):
    """state_dict() leaves the generator's stream untouched, and an env loaded from it (on the same kind of device,
    also from a checkpoint older than its "seed") steps on exactly as the one that was saved."""
    env, twin, push = P.CartPole(8, "cpu", seed=0), P.CartPole(8, "cpu", seed=0), torch.ones(8, dtype=torch.long)
    for _ in range(15):
        env.step(push)
        twin.step(push)
    saved = checkpointed(env.state_dict())
    old = {k: v for k, v in saved.items() if k != "seed"}
    resumed, resumed_old = P.CartPole(8, "cpu", seed=1), P.CartPole(8, "cpu", seed=2)
    assert torch.equal(resumed.load_state_dict(saved), env.state)
    assert torch.equal(resumed_old.load_state_dict(old), env.state)
    restarted = torch.zeros(8, dtype=torch.bool)
    for _ in range(40):  # pushed one way, the poles fall and restart from states the generator draws
        steps = [e.step(push) for e in (env, twin, resumed, resumed_old)]
        assert all(torch.equal(steps[0][0], obs) for obs, *_ in steps[1:])
        restarted |= steps[0][2]
    assert restarted.all() and torch.equal(env.draw_initial_states(3, 8), resumed.draw_initial_states(3, 8))


def test_a_checkpoint_of_the_other_kind_of_device_reseeds_from_its_seed(P):
    """A generator's state is device-specific (a CPU one's 5,056 bytes, a CUDA one's 16): an env resumed on the other
    kind of device cannot set it, and goes on from the seed drawn when it was saved. Here on the CPU only: a
    checkpoint whose generator state is 16 bytes, as a CUDA generator's is."""
    saved = checkpointed(P.CartPole(8, "cpu", seed=0).state_dict())
    saved["generator"] = torch.zeros(16, dtype=torch.uint8)
    a, b, push = P.CartPole(8, "cpu", seed=1), P.CartPole(8, "cpu", seed=2), torch.ones(8, dtype=torch.long)
    assert torch.equal(a.load_state_dict(saved), saved["state"])
    assert torch.equal(b.load_state_dict(saved), a.state)
    assert torch.equal(a.generator.get_state(), torch.Generator().manual_seed(int(saved["seed"])).get_state())
    for _ in range(40):
        assert torch.equal(a.step(push)[0], b.step(push)[0])


def test_shaped_envs(P):
    states = torch.from_numpy(random_states(1000, 5))
    easy, spin = P.EasyCart(1000, "cpu"), P.SpinCart(1000, "cpu")
    easy.reset(), spin.reset()
    easy.state, spin.state = states.clone(), states.clone()
    _, r_easy, term_easy, _, info = easy.step(torch.ones(1000, dtype=torch.long))
    assert r_easy.min() >= 0.0 and r_easy.max() <= 1.0
    upright = P.EasyCart(1, "cpu")
    upright.state = torch.zeros(1, 4)
    assert upright.reward_function(torch.zeros(1, dtype=torch.long)).item() == 1.0
    # SpinCart: a pole past 12 degrees does not end the episode, leaving the track does
    spin.state = torch.tensor([[0.0, 0.0, math.pi, 20.0]] * 500 + [[2.5, 0.0, 0.0, 0.0]] * 500)
    _, r_spin, term_spin, _, _ = spin.step(torch.zeros(1000, dtype=torch.long))
    assert not term_spin[:500].any() and term_spin[500:].all()
    assert r_spin[:500].min() > 0.9  # fast spin at the centre earns nearly the maximum


def test_draw_frames(P, tmp_path):
    frames = P.draw(torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.5, 0.0]]), width=150, height=100)
    assert frames.shape == (2, 100, 150, 3) and frames.dtype == torch.uint8
    # upright pole above the centred cart; cart black at the track; background white
    assert frames[0, 50, 75].tolist() == [202, 152, 101]
    assert frames[0, 75, 75].tolist() == [0, 0, 0]
    assert frames[0, 10, 10].tolist() == [255, 255, 255]
    # the second cart sits 1 m right of centre (150 px / 4.8 m) and its pole leans right
    assert frames[1, 75, 75 + round(150 / 4.8)].tolist() == [0, 0, 0]
    assert frames[1, 72, 75].tolist() == [255, 255, 255]
    pole = (frames[1] == torch.tensor([202, 152, 101], dtype=torch.uint8)).all(-1).nonzero().float()
    assert pole[:, 1].mean() > 75 + 150 / 4.8
    # the grid is as square as the envs fill without a wasted row: 3 envs 1x3, 10 envs 3x4, 16 or more 4x4
    for envs, (rows, cols) in ((3, (1, 3)), (10, (3, 4)), (16, (4, 4)), (64, (4, 4))):
        path = P.grid_video(str(tmp_path / f"{envs}.mp4"), torch.zeros(5, envs, 4), fps=50)
        with imageio.get_reader(path) as video:
            frames = [frame for frame in video]
        assert len(frames) == 5 and frames[0].shape == (rows * 100, cols * 150, 3)
