"""--compile: inductor's settings for a run's graphs, and what stops a graph in one line."""

import os
import re

import torch


def compile_settings() -> None:
    """What --compile sets before a run compiles, the caches of an earlier run's graphs cleared."""
    import torch._inductor.config as inductor  # (not imported by `import torch`)

    inductor.fallback_random = True  # random ops (dropout) draw as eager ones do: the same numbers
    # the gradient by torch.autograd.grad, as eager: compiled torch.func.grad gets dropout wrong (docs/modifying.md)
    if hasattr(torch._dynamo.config, "trace_autograd_ops"):  # (an older torch: torch.func.grad, ladder/optim.py)
        torch._dynamo.config.trace_autograd_ops = True
    # ops inlined per kernel (CPU default 50: a Pendulum rollout took 435 s to compile, at 30 59 s; compile_time.py)
    if hasattr(inductor, "realize_cpu_opcount_threshold"):
        inductor.realize_cpu_opcount_threshold = 30
    # else torch 2.13 drops in-place updates of 0-dim float64 tensors (test_compile.py); read at a first compilation
    os.environ["TENSORIFY_PYTHON_SCALARS"] = "0"
    torch.compiler.reset()  # a script's phases compile anew, not against the limit of recompilations of a run before


def compile_error(e: BaseException | None) -> str | None:
    """One line for what stopped a compiled graph (dynamo's error, which names the line of the script), else None."""
    if not isinstance(e, Exception):  # a signal's KeyboardInterrupt, maybe in the midst of importing torch._dynamo
        return None
    if not isinstance(e, (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)):
        return None
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    cause, where = lines[0], [f" ({line})" for line in lines if line.startswith("File ")][-1:]  # your line
    if ours := re.search(r"raised exception UsageError\('(.+)'\)", str(e.__cause__)):  # ladder's own words
        cause = ours[1]
    elif "Could not guard on data-dependent" in str(e):  # (dynamo's first words: "Consider ... torch._check*()")
        cause = "a branch on a tensor's value or a host read (.item()) cannot be compiled: keep it out of the phase"
    elif "Optimizer.zero_grad" in str(e):  # CleanRL's update with a torch.optim optimizer
        cause = "torch.optim's zero_grad is one dynamo will not compile: use ladder.optim.Adam, or a subclass of it"
    if isinstance(e, torch._dynamo.exc.FailOnRecompileLimitHit):  # dynamo's last reason: the guard that failed
        reasons = max(torch._dynamo.utils.guard_failures.values(), key=len, default=[])
        guard = " ".join(reasons[-1].split("User stack trace")[0].split()) if reasons else "a value changed"
        cause = f"it compiles again at every call, as {guard}"
    return f"--compile: {cause}{''.join(where)}; see docs/modifying.md#compiled-graphs"
