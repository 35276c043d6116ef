"""Kernels per iteration of ppo_cartpole_gpu.py, counted on the CPU on the code path a CUDA device takes (the env's
sync-free reset): what a GPU launches one by one eagerly, and what a CUDA graph replays at ~3 µs each. Prints one
markdown table with the command and the machine.

- kernel ops: the leaf aten ops of one iteration (the loop body between two `run.log`s: noise, rollout, batch,
  every gradient step, backward included), without views, metadata, `resolve_conj` or host reads (issue 57's
  definition), by phase;
- of them CPU-only: what torch's CPU kernels add and a GPU does not launch: a Python number or 0-dim CPU tensor
  copied to the op's dtype (`_to_copy` of a 0-dim input; CUDA takes it as a kernel argument), and the zero-fill of
  a reduction's output (`fill_` under `sum`, `mean`, ...);
- top-level aten ops: the ops the Python code calls;
- with --compile: the kernels inductor generated (its C++ kernels, each recorded by the profiler) plus the aten ops
  the compiled code still calls (matmuls).

    python benchmarks/kernels.py                                  # 128 and 4096 envs, this checkout
    python benchmarks/kernels.py --num-envs 128 --no-compile --ops 12   # and where the GPU's kernels go, by phase
    git worktree add /tmp/ee87a1a ee87a1a && python benchmarks/kernels.py --root /tmp/ee87a1a   # an older commit
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_KERNELS = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::expand", "aten::t",
    "aten::transpose", "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::slice",
    "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::alias", "aten::detach", "aten::detach_",
    "aten::_unsafe_view", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::resolve_conj",
    "aten::resolve_neg", "aten::lift_fresh", "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero",
    "aten::result_type", "aten::size", "aten::stride", "aten::numel", "aten::dim", "aten::is_same_size",
    "aten::contiguous", "aten::to", "aten::_to_copy", "aten::set_", "aten::_has_compatible_shallow_copy_type",
    "aten::chunk", "aten::narrow", "aten::movedim", "aten::mT", "aten::numpy_T", "aten::flatten", "aten::view_as",
    "aten::expand_as", "aten::broadcast_tensors", "aten::unflatten", "aten::type_as", "aten::_shape_as_tensor",
}  # fmt: skip
"""Ops that launch no kernel of their own (a view, metadata) or are a host read: `to`/`_to_copy` count through
the `copy_` under them."""


@dataclass
class KernelArgs:
    num_envs: tuple[int, ...] = (128, 4096)
    """env counts to count at (ppo_cartpole_gpu.py's defaults otherwise)"""
    root: str = ROOT
    """the checkout whose ppo_cartpole_gpu.py and ladder/ are counted (a `git worktree` of another commit)"""
    compile: bool = True
    """also count the kernels of the --compile iteration"""
    ops: int = 0
    """also list, for eager at the first env count, each phase's N most frequent GPU kernels (CPU-only ones left out)
    by the op the code called"""
    one: str = ""
    """(internal) count one configuration, "num_envs,compile", in this process, and print its JSON"""


def count_one(root: str, num_envs: int, compile: bool) -> dict:
    """The counts of iteration 3 of `root`'s ppo_cartpole_gpu.py at `num_envs`, eager or compiled."""
    sys.path.insert(0, root)
    import torch
    from torch.profiler import profile

    import ppo_cartpole_gpu as P

    torch.set_num_threads(1)
    init = P.CartPole.__init__

    def gpu_reset(self, *args, **kwargs):  # the reset a CUDA device takes: no host read of which envs ended
        init(self, *args, **kwargs)
        self.sync_free_reset = True

    P.CartPole.__init__ = gpu_reset
    if compile:
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True  # each generated C++ kernel: one profiler event
    real_log, box = P.Run.log, {"logs": 0}
    phases = ["collect_rollout", "make_batch", "update"]
    for name in phases:  # each phase's ops under a label (train() reads these names when it runs)
        setattr(P, name, labelled(name, getattr(P, name)))
    P.RolloutNoise.draw = staticmethod(labelled("noise", P.RolloutNoise.draw))

    def log(self, *args, **kwargs):  # iteration 3: from the end of the 2nd log to the start of the 3rd
        box["logs"] += 1
        if box["logs"] == 3:
            box["prof"].__exit__(None, None, None)
        out = real_log(self, *args, **kwargs)
        if box["logs"] == 2:
            box["prof"] = profile(record_shapes=True)
            box["prof"].__enter__()
        return out

    P.Run.log = log
    args = P.Args(num_envs=num_envs, total_timesteps=4 * num_envs * 16, target_return=None, eval_episodes=0,
                  progress_bar=False, device="cpu", compile=compile)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        P.train(args)
    events = [e for e in box["prof"].events()]
    aten = [e for e in events if e.name.startswith("aten::")]
    leaves = [e for e in aten if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    kernels = [e for e in leaves if e.name not in NOT_KERNELS]
    cpu_only = [e for e in kernels if cpu_only_op(e)]
    by_phase = {name: sum(phase(e) == name for e in kernels) for name in ["noise", *phases]}
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    generated = [e for e in events if "cpp_fused" in e.name or e.name.startswith("cpp_")]
    names: dict[str, int] = {}
    for e in kernels:
        names[e.name] = names.get(e.name, 0) + 1
    by_op: dict[str, dict[str, int]] = {}  # the kernels a GPU launches, by phase, as "the code's op -> the kernel"
    for e in kernels:
        if not cpu_only_op(e):
            ops, key = by_op.setdefault(phase(e) or "(none)", {}), f"{top_level(e).name[6:]} -> {e.name[6:]}"
            ops[key] = ops.get(key, 0) + 1
    return dict(kernels=len(kernels), cpu_only=len(cpu_only), top=len(top), generated=len(generated), names=names,
                by_phase=by_phase, by_op=by_op, minibatches=args.update_epochs * args.num_minibatches)  # fmt: skip


def top_level(event):
    """The aten op the Python code called that `event` runs under (itself when it is one)."""
    while event.cpu_parent is not None and event.cpu_parent.name.startswith("aten::"):
        event = event.cpu_parent
    return event


def labelled(name: str, fn):
    """`fn` with its ops under the profiler label "phase: `name`"."""
    import functools

    from torch.profiler import record_function

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with record_function(f"phase: {name}"):
            return fn(*args, **kwargs)

    return call


def phase(event) -> str:
    """The phase label an op ran under ("" for none)."""
    while event is not None and not event.name.startswith("phase: "):
        event = event.cpu_parent
    return "" if event is None else event.name[7:]


def cpu_only_op(event) -> bool:
    """A copy of a 0-dim input to the op's dtype, or the zero-fill of a reduction's output: CPU kernels' own."""
    parent = event.cpu_parent
    if event.name == "aten::copy_" and parent is not None and parent.name == "aten::_to_copy":
        return parent.input_shapes[:1] == [[]]
    reductions = ("aten::sum", "aten::mean", "aten::std", "aten::var", "aten::var_mean", "aten::std_mean")
    return event.name in ("aten::fill_", "aten::zero_") and parent is not None and parent.name in reductions


def main() -> None:
    bench = tyro.cli(KernelArgs)
    if bench.one:
        num_envs, compile = bench.one.split(",")
        print(json.dumps(count_one(bench.root, int(num_envs), compile == "1")))
        return
    sys.path.insert(0, ROOT)
    from benchmarks.common import machine

    commit = subprocess.run(["git", "-C", bench.root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    rows = []
    for n in bench.num_envs:
        for compile in (False, True) if bench.compile else (False,):
            one = [sys.executable, __file__, "--root", bench.root, "--one", f"{n},{int(compile)}"]
            result = subprocess.run(one, capture_output=True, text=True, check=True)  # a fresh process each
            rows.append((n, compile, json.loads(result.stdout.strip().splitlines()[-1])))
    print(f"`python benchmarks/kernels.py {' '.join(sys.argv[1:])}` at {commit.stdout.strip()}; {machine()}\n")
    print("| envs | mode | kernel ops per iteration | of them CPU-only | noise / rollout / batch / update (per "
          "minibatch) | inductor kernels | top-level aten ops | most frequent |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for n, compile, c in rows:
        common = ", ".join(f"{k[6:]} {v}" for k, v in sorted(c["names"].items(), key=lambda kv: -kv[1])[:4])
        mode, generated = ("--compile", c["generated"]) if compile else ("eager", "")
        p, m = c["by_phase"], c["minibatches"]
        phases = f"{p['noise']} / {p['collect_rollout']} / {p['make_batch']} / {p['update']} ({p['update'] / m:.0f})"
        print(f"| {n} | {mode} | {c['kernels']:,} | {c['cpu_only']:,} | {phases} | {generated} | {c['top']:,} "
              f"| {common} |")  # fmt: skip
    n, _, c = rows[0]
    for name, ops in c["by_op"].items() if bench.ops else ():
        listed = sorted(ops.items(), key=lambda kv: -kv[1])[: bench.ops]
        shown = ", ".join(f"{op} {count}" for op, count in listed)
        print(f"\n- {n} envs, eager, {name}: {sum(ops.values()):,} GPU kernels; {shown}")


if __name__ == "__main__":
    main()
