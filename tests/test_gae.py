"""GAE on the device (each script that has a critic carries the same one) against a plain per-env loop."""

import numpy as np
import pytest
import torch

from conftest import import_script
from reference import reference_gae

pytestmark = pytest.mark.quick  # in the two-minute run: python -m pytest -m quick


@pytest.fixture(params=["ppo_cartpole_gpu", "vpg", "ppo_atari_envpool", "ppo_mujoco_brax"])
def P(request):
    """Every script's own copy of compute_gae."""
    return import_script(request.param)


def test_gae_matches_reference_loop(P):
    rng = np.random.default_rng(0)
    T, N, gamma, lam = 33, 17, 0.97, 0.9
    rewards = rng.normal(size=(T, N))
    values = rng.normal(size=(T, N))
    last_values = rng.normal(size=N)
    final_values = rng.normal(size=(T, N))
    ends = rng.random((T, N))
    terminated = ends < 0.1
    truncated = (ends >= 0.1) & (ends < 0.2)
    dones = terminated | truncated
    # the trainer's convention: next_values[t] = V(s'_t), the real next state of step t
    next_values = np.where(dones, final_values, np.vstack([values[1:], last_values[None]]))
    next_values[terminated] = rng.normal(size=terminated.sum())  # must be ignored where terminated

    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    adv, ret = P.compute_gae(t(rewards), t(values), t(next_values), torch.as_tensor(terminated),
                             torch.as_tensor(dones), gamma, lam)  # fmt: skip
    ref_adv, ref_ret = reference_gae(rewards, values, last_values, final_values, terminated, truncated, gamma, lam)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ret.numpy(), ref_ret, rtol=1e-12, atol=1e-12)
    assert terminated.any() and truncated.any()


def test_truncation_bootstraps_but_termination_does_not(P):
    ones = torch.ones(1, 1)
    no = torch.zeros(1, 1, dtype=torch.bool)
    yes = torch.ones(1, 1, dtype=torch.bool)
    adv_trunc, _ = P.compute_gae(ones, 0 * ones, 10 * ones, no, yes, 0.9, 0.95)
    adv_term, _ = P.compute_gae(ones, 0 * ones, 10 * ones, yes, yes, 0.9, 0.95)
    assert adv_trunc.item() == 1 + 0.9 * 10 and adv_term.item() == 1.0


def test_lambda_one_gives_discounted_returns(P):
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.5], [0.1], [-0.2]])
    next_values = torch.tensor([[0.1], [-0.2], [7.0]])
    no = torch.zeros(3, 1, dtype=torch.bool)
    _, ret = P.compute_gae(rewards, values, next_values, no, no, 0.5, 1.0)
    expected = [1 + 0.5 * 2 + 0.25 * 3 + 0.125 * 7, 2 + 0.5 * 3 + 0.25 * 7, 3 + 0.5 * 7]
    torch.testing.assert_close(ret[:, 0], torch.tensor(expected))
