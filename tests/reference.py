"""Plain-loop reference implementations that the vectorised tensor versions are checked against."""

import numpy as np


def reference_gae(rewards, values, last_values, final_values, terminated, truncated, gamma, lam):
    """Textbook per-env backward loop. `final_values[t]` is V(final_obs) where an episode ended."""
    T, N = rewards.shape
    adv = np.zeros((T, N))
    for n in range(N):
        gae = 0.0
        for t in reversed(range(T)):
            if terminated[t, n]:
                next_value, gae = 0.0, 0.0
            elif truncated[t, n]:  # cut by the time limit: bootstrap from the last observation
                next_value, gae = final_values[t, n], 0.0
            else:
                next_value = values[t + 1, n] if t + 1 < T else last_values[n]
            delta = rewards[t, n] + gamma * next_value - values[t, n]
            gae = delta + gamma * lam * gae
            adv[t, n] = gae
    return adv, adv + values


def reference_returns(rewards, dones, gamma):
    """Reward-to-go per env, one step at a time: G_t = r_t + gamma * G_{t+1}, restarted at episode ends."""
    T, N = rewards.shape
    out = np.zeros((T, N))
    for n in range(N):
        g = 0.0
        for t in reversed(range(T)):
            if dones[t, n]:
                g = 0.0
            g = rewards[t, n] + gamma * g
            out[t, n] = g
    return out
