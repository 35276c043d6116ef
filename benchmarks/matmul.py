"""The matmuls of ppo_cartpole_gpu.py's minibatch step (512 rows, 64-64 tanh nets, 2 actions), timed one by one in
torch (MKL on x86, as `--compile` calls them: inductor's CPU code leaves float32 matmuls to aten) and in XLA (a dot
inside a jitted program, as the JAX peer runs them), on one core. Prints one markdown table with the command and the
machine: where the compiled iteration's time goes that fusion cannot win back (docs/benchmarks.md, issue 66).

    taskset -c 0 python benchmarks/matmul.py
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine  # noqa: E402

SHAPES = [(512, 4, 64), (512, 64, 64), (512, 64, 2), (512, 64, 1), (64, 512, 64)]
"""(m, k, n) of the step's forward (obs -> 64, 64 -> 64, the heads) and of a weight's gradient (64 x 512 @ 512 x 64)"""
DOTS = 20
"""dots per jitted call, so that JAX's dispatch is spread over them"""


def microseconds(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def one_shape(m: int, k: int, n: int) -> tuple[float, float]:
    """Microseconds of one (m, k) @ (k, n) float32 matmul: torch.mm, and a dot in XLA."""
    a, b, out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    ours = microseconds(lambda: torch.mm(a, b, out=out), 3000)
    x, y = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
    dots = jax.jit(lambda x, y: sum((x * (i + 1)) @ y for i in range(DOTS)))  # each dot its own: no reuse
    dots(x, y).block_until_ready()
    return ours, microseconds(lambda: dots(x, y).block_until_ready(), 300) / DOTS


def main() -> None:
    torch.set_num_threads(1)
    print(f"`python benchmarks/matmul.py` on {machine(jax)}\n")
    print("| m x k @ k x n | torch.mm, µs | XLA dot in a jit, µs | torch / XLA |")
    print("|---|---|---|---|")
    for m, k, n in SHAPES:
        ours, theirs = one_shape(m, k, n)
        print(f"| {m} x {k} @ {k} x {n} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
