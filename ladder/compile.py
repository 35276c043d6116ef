"""--compile: a phase of an iteration (a function of tensors) as one graph, what stops it in one line."""

import functools
import os
import re
import weakref

import torch

from ladder.flags import UsageError


def compiled(fn):
    """torch.compile'd `fn` as one graph (a break is an error, not a silent slowdown), or one line saying why not."""
    import torch._inductor.config as inductor  # (not imported by `import torch`)

    inductor.fallback_random = True  # random ops (dropout) draw as eager ones do: the same numbers
    # the gradient by torch.autograd.grad, as eager: compiled torch.func.grad gets dropout wrong (docs/modifying.md)
    if hasattr(torch._dynamo.config, "trace_autograd_ops"):  # (an older torch: torch.func.grad, ladder/optim.py)
        torch._dynamo.config.trace_autograd_ops = True
    # ops inlined per kernel (CPU default 50: a Pendulum rollout took 435 s to compile, at 30 59 s; compile_time.py)
    bound = {"realize_cpu_opcount_threshold": 30} if hasattr(inductor, "realize_cpu_opcount_threshold") else {}
    # dynamo keeps its graphs in the compiled function's globals: here a caller's own, emptied once the call is gone
    scope = {"fn": fn}
    graph = torch.compile(eval("lambda *args, **kwargs: fn(*args, **kwargs)", scope), fullgraph=True, options=bound)
    # else torch 2.13 drops in-place updates of 0-dim float64 tensors (test_compile.py); read at a first compilation
    os.environ["TENSORIFY_PYTHON_SCALARS"] = "0"

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return graph(*args, **kwargs)
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            cause, where = lines[0], [f" ({line})" for line in lines if line.startswith("File ")][-1:]  # your line
            if ours := re.search(r"raised exception UsageError\('(.+)'\)", str(e.__cause__)):  # ladder's own words
                cause = ours[1]
            elif "Optimizer.zero_grad" in str(e):  # CleanRL's update with a torch.optim optimizer
                cause = "torch.optim's zero_grad is one dynamo will not compile: use ladder.optim.Adam"
            if isinstance(e, torch._dynamo.exc.FailOnRecompileLimitHit):  # dynamo's last reason: the guard that failed
                reasons = max(torch._dynamo.utils.guard_failures.values(), key=len, default=[])
                guard = " ".join(reasons[-1].split("User stack trace")[0].split()) if reasons else "a value changed"
                cause = f"it compiles again at every call, as {guard}"
            raise UsageError(f"--compile: {cause}{''.join(where)}; see docs/modifying.md#compiled-graphs") from None

    weakref.finalize(call, lambda: scope.update(dict.fromkeys(scope)))  # values dropped; dynamo deletes the names
    return call
