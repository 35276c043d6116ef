"""`--compile`: the compiled phases compute what the eager ones do, in single graphs that compile once.

torch.compile builds C++ kernels on the CPU (a C++ compiler is needed, as in CI). The first compilation
of each phase takes seconds; the tests reuse one shape per script so that cost is paid once.
"""

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import guard_failures

from conftest import (
    SCRIPTS,
    assert_close,
    assert_same_agents,
    compiled_as_in_a_run,
    import_script,
    origin,
    read_json,
    retarget,
)
from ladder.optim import Adam
from test_optim import fixed_batch, torch_step

# small but real: several episodes end and restart inside the rollouts
SMALL = dict(num_envs=16, num_steps=8, total_timesteps=16 * 8 * 4, eval_episodes=0, progress_bar=False)


def graph_count() -> int:
    """Graphs dynamo has compiled in this process (a recompilation adds one)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def recompilations() -> str:
    """Why dynamo compiled a function again (each guard that failed, with the line it guards), for the message of a
    failing graph count: before, `assert (6 - 0) == 3` named nothing."""
    reasons = [
        f"{code.co_name}: {' '.join(reason.split())}" for code, failed in guard_failures.items() for reason in failed
    ]
    return "recompiled as " + "; ".join(reasons) if reasons else "no recompilation"


def trained(name, in_tmp, **flags):
    mod = import_script(name)
    small = dict(SMALL, num_minibatches=2, update_epochs=2) if origin(name) == "ppo_cartpole_gpu" else SMALL
    if origin(name) == "reinforce":  # rollouts run until every env has finished an episode: 3-4 of them here
        small = dict(SMALL, num_steps=500, total_timesteps=16 * 100)
    return mod.train(mod.Args(seed=3, **small, **flags))


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_compiled_training_matches_eager(name, in_tmp):
    """Same seed, same random numbers (drawn outside the graphs): the weights after 4 iterations agree
    to float tolerance (the graphs write tanh as 2σ(2x) - 1 and Adam's update out, both exact to ~1e-7),
    and each phase compiled to one graph, once (PPO: the rollout, the batch and an epoch's steps; VPG: the whole
    iteration; REINFORCE's gradient step, whose batch size varies, to one graph for
    every size from the first: else a resumed run would start on a static-shape graph the run straight through had
    left behind, and end elsewhere)."""
    torch._dynamo.reset()
    eager = trained(name, in_tmp)
    before = graph_count()
    compiled = trained(name, in_tmp, compile=True)
    expected = {"ppo_cartpole_gpu": 3, "vpg": 1, "reinforce": 2}[origin(name)]  # a copy may compile more of its own
    assert graph_count() - before >= expected and recompilations() == "no recompilation", recompilations()
    assert_same_agents(compiled, eager, "compiled", atol=2e-4, rtol=1e-3)


@pytest.mark.behaviour
@pytest.mark.parametrize("script", retarget(["ppo_cartpole_gpu"]))
def test_target_kl_stops_the_compiled_epochs_where_eager_ones_stop(script, in_tmp):
    """--target-kl reads the KL between epochs, outside the compiled epoch (issue 66): at a target of 1e-9 every
    update stops after its first epoch, compiled as eager (else the weights part), with no graph compiled again."""
    torch._dynamo.reset()
    eager = trained(script, in_tmp, target_kl=1e-9)
    before = graph_count()
    compiled = trained(script, in_tmp, target_kl=1e-9, compile=True)
    assert graph_count() - before == 3 and recompilations() == "no recompilation", recompilations()
    assert_same_agents(compiled, eager, "compiled", atol=2e-4, rtol=1e-3)
    all_epochs = trained(script, in_tmp)  # the check can fail: without the stop the weights differ
    assert not all(torch.allclose(a, b, atol=2e-4) for a, b in zip(eager.parameters(), all_epochs.parameters()))


def test_compiled_brax_training_matches_eager(in_tmp):
    """ppo_mujoco_brax.py --compile: the batch preparation and the gradient step compile to one graph each
    (the rollout stays eager: its env step is JAX), and the weights after 3 iterations agree with eager."""
    mod = import_script("ppo_mujoco_brax")
    flags = dict(env_id="inverted_pendulum", num_envs=16, num_steps=8, num_minibatches=2, update_epochs=2,
                 total_timesteps=16 * 8 * 3, eval_episodes=0, progress_bar=False, device="cpu", seed=3)  # fmt: skip
    torch._dynamo.reset()
    eager = mod.train(mod.Args(**flags))
    before = graph_count()
    compiled = mod.train(mod.Args(**flags, compile=True))
    assert graph_count() - before == 2, recompilations()
    for (key, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        assert_close(a, b, key, atol=2e-4, rtol=1e-3)


def test_a_recompilation_is_named_by_the_guard_that_failed():
    """A graph count that fails says why a function compiled again: here a Python value it branches on changed."""
    torch._dynamo.reset()
    mode = {"clip": True}
    f = torch.compile(lambda x: x.clamp(-1, 1) if mode["clip"] else x, fullgraph=True)
    f(torch.randn(3))
    assert recompilations() == "no recompilation"
    mode["clip"] = False
    f(torch.randn(3))
    assert "mode['clip']" in recompilations() and "<lambda>" in recompilations(), recompilations()


def test_tanh_is_the_same_compiled():
    mod = import_script("ppo_cartpole_gpu")
    x = torch.linspace(-30, 30, 10001)
    torch.testing.assert_close(torch.compile(mod.Tanh())(x), torch.tanh(x), atol=3e-7, rtol=0)
    grad = torch.func.grad(lambda v: torch.compile(mod.Tanh())(v).sum())(x)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, 1 - torch.tanh(x) ** 2, atol=1e-6, rtol=0)


@pytest.mark.learning
@pytest.mark.parametrize("name", ["ppo_cartpole_gpu"])
def test_compiled_defaults_solve_cartpole(name, in_tmp):
    """The defaults with --compile solve CartPole, and SPS leaves out iteration 1 (compilation)."""
    import glob

    mod = import_script(name)
    mod.train(mod.Args(compile=True, progress_bar=False, seed=1))
    (path,) = glob.glob(str(in_tmp / "runs" / "*" / "summary.json"))
    summary = read_json(path)
    assert summary["solved_at_step"] is not None and summary["solved_at_step"] <= 400_000, summary
    assert summary["eval_mean_return"] >= 475
    assert summary["mean_sps"] * summary["wall_seconds"] < summary["total_env_steps"]  # iteration 1 not counted


def test_a_loss_may_call_any_agent_method_compiled_too():
    """The gradient step hands the loss the real Agent (its parameters swapped in by functional_call), so a loss that
    calls `agent.get_value` takes the same step compiled as torch.optim takes eagerly."""
    mod = import_script("ppo_cartpole_gpu")

    def loss_fn(agent, args, batch):  # PPO's loss plus a term through another method of the agent
        loss, stats = mod.ppo_loss(agent, args, batch)
        return loss + 0.1 * agent.get_value(batch.obs).square().mean(), stats

    torch.manual_seed(0)
    agent, args, batch = mod.Agent(4, 2), mod.Args(), fixed_batch(mod, 32)
    twin = copy.deepcopy(agent)
    opt, twin_opt = Adam(agent, lr=1e-2, eps=1e-5), torch.optim.Adam(twin.parameters(), lr=1e-2, eps=1e-5)
    torch._dynamo.reset()
    compiled_as_in_a_run(mod.gradient_step)(agent, opt, loss_fn, args, batch)
    torch_step(twin, twin_opt, loss_fn, args, batch)
    assert_same_agents(agent, twin, "compiled", atol=1e-6, rtol=1e-5)


class Statistics(torch.nn.Module):
    """A running count kept as a 0-dim float64 buffer (as a running mean's), updated in place and not returned."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))


def count_twice(compile_with) -> float:
    """The buffer after two calls of `compile_with(update)`: 6.0 as eager has it, 0.0 where the update is dropped."""
    statistics, x = Statistics(), torch.ones(3)

    def update(statistics, x):
        statistics.count.copy_(statistics.count + x.sum())

    torch._dynamo.reset()
    update = compile_with(update)
    with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings():  # a cached graph (and
        warnings.filterwarnings("ignore", "dynamo_pgo force disabled")  # dynamo's record of earlier runs) would hide it
        update(statistics, x)
        update(statistics, x)
    return float(statistics.count)


def test_torch_still_drops_a_float64_scalars_update():
    """The torch bug `ladder.compile.compile_settings` works around (torch 2.13, CPU): torch.compile drops the in-place
    update of a 0-dim float64 tensor that the function does not return. Skips once torch computes it: the workaround
    can go.
    In a process of its own: dynamo's record of a function's first compilation outlives torch._dynamo.reset() (compiled
    with ladder's settings first, the same function keeps its update under torch.compile too)."""
    code = "import torch, test_compile; print(test_compile.count_twice(lambda f: torch.compile(f, fullgraph=True)))"
    env = {k: v for k, v in os.environ.items() if k != "TENSORIFY_PYTHON_SCALARS"}  # (ladder.compile sets it here)
    result = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), capture_output=True, text=True,
                            timeout=300, env=env)  # fmt: skip
    count = float(result.stdout.split()[-1]) if result.returncode == 0 else result.stderr[-2000:]
    if count == 6.0:
        pytest.skip(f"torch {torch.__version__} keeps the update: ladder.compile's TENSORIFY_PYTHON_SCALARS can go")
    assert count == 0.0


def test_a_float64_scalars_update_is_kept_compiled():
    """With ladder's settings (what a --compile run compiles its phases with) the update is kept, as eagerly: a copy's
    running statistics (their count) go on counting compiled. Before, the count stayed where it started."""
    assert count_twice(lambda fn: fn) == 6.0
    assert count_twice(compiled_as_in_a_run) == 6.0


def test_torch_still_cannot_compile_the_gradient_of_a_module_in_two_places():
    """Why ladder's functional_calls (Adam.call_with, the stacked call) give each place of a shared parameter its
    tensor with tie_weights=False: torch 2.13 cannot compile torch.func.grad over a functional_call of a module in two
    places that ties them (the default). Skips once torch can."""
    shared = torch.nn.Linear(3, 3)
    module = torch.nn.Sequential(shared, torch.nn.Tanh(), shared)
    parameters = dict(module.named_parameters())

    def gradient(parameters, x):
        return torch.func.grad(lambda p: torch.func.functional_call(module, p, (x,)).sum())(parameters)

    torch._dynamo.reset()
    try:
        torch.compile(gradient, fullgraph=True)(parameters, torch.randn(2, 3))
    except Exception as e:  # torch's own, whichever it raises
        assert "TensorWrapper" in str(e) or "functorch" in str(e), str(e)[:500]
    else:
        pytest.skip(f"torch {torch.__version__} compiles it")


def test_torch_still_refuses_a_scan_that_steps_weights_in_place():
    """Why --compile makes a graph of each epoch, not one looping over the minibatches (issue 66, docs/benchmarks.md):
    torch 2.13's scan refuses a body that updates a tensor it closes over, as an optimizer's step updates the
    weights. Skips once torch can."""
    from torch._higher_order_ops import scan

    weights = torch.zeros(4)

    def step(total, gradient):
        weights.sub_(0.1 * gradient)
        return total + weights.sum(), weights.clone()

    torch._dynamo.reset()
    try:
        torch.compile(lambda: scan(step, torch.zeros(()), torch.randn(3, 4)), fullgraph=True)()
    except Exception as e:  # torch's own, whichever it raises
        assert "input mutation" in str(e), str(e)[:500]
    else:
        pytest.skip(f"torch {torch.__version__} compiles it")


def test_the_inductor_option_is_set_only_where_torch_has_it(monkeypatch):
    """torch 2.11 (on the H200 machine) has no `realize_cpu_opcount_threshold`, and `torch.compile(options=...)` with
    it raised "Unexpected optimization option", failing every compiled CUDA test there. Faked here: a torch without
    the option gets none; the pinned one gets it (it bounds CPU codegen only, so CUDA graphs ignore it)."""
    import types

    import torch._inductor

    from ladder.compile import compile_settings

    older = types.SimpleNamespace(fallback_random=False)  # as torch 2.11's
    with monkeypatch.context() as patched:
        patched.setattr(torch._inductor, "config", older)
        patched.setattr(torch.compiler, "reset", lambda: None)  # (which reads the real config)
        compile_settings()
    assert vars(older) == {"fallback_random": True}
    with torch._inductor.config.patch(realize_cpu_opcount_threshold=50):
        compile_settings()
        assert torch._inductor.config.realize_cpu_opcount_threshold == 30


def dropout_after_layernorm(p: dict, x: torch.Tensor) -> torch.Tensor:
    """The smallest loss found that torch 2.13's CPU compiler gets wrong under torch.func.grad (issue 64)."""
    h = torch.nn.functional.layer_norm(x @ p["w1"], (64,), p["lw"], p["lb"]).tanh()
    return (torch.nn.functional.dropout(h, 0.1, training=True) @ p["w2"]).square().mean()


def dropout_after_layernorm_inputs() -> tuple[dict, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    p = dict(w1=torch.randn(4, 64, generator=generator), lw=torch.ones(64), lb=torch.zeros(64))
    return p | dict(w2=torch.randn(64, 1, generator=generator)), torch.randn(32, 4, generator=generator)


def test_torch_still_reads_a_dropout_mask_before_drawing_it():
    """The torch bug that makes --compile take the gradient by torch.autograd.grad (ladder/compile.py): compiled on the
    CPU, torch.func.grad of LayerNorm, tanh, then dropout draws the mask (an in-place `bernoulli_` on a buffer) after
    the kernel that multiplies by it, so the dropout's output, and here the loss, is 0. Skips once torch fixes it."""
    p, x = dropout_after_layernorm_inputs()
    torch._dynamo.reset()
    _, loss = torch.compile(torch.func.grad_and_value(dropout_after_layernorm), fullgraph=True)(p, x)
    if loss != 0:
        pytest.skip(f"torch {torch.__version__} draws the mask first: the compiled gradient may be torch.func.grad's")
    assert dropout_after_layernorm(p, x) > 1.0  # eager: the loss of a real mask


def test_the_compiled_gradient_draws_the_dropout_masks_eager_draws():
    """The same loss through Adam.backward, compiled with ladder's settings: the same mask, loss and gradient
    as eager (torch.autograd.grad traced, dropout's masks drawn by eager's kernel)."""
    p, x = dropout_after_layernorm_inputs()
    module = torch.nn.Module()
    for name, value in p.items():
        module.register_parameter(name, torch.nn.Parameter(value.clone()))
    adam = Adam(module)
    loss_fn = lambda module, x: (dropout_after_layernorm(dict(module.named_parameters()), x), {})  # noqa: E731
    torch._dynamo.reset()

    def gradient(x):
        adam.zero_grad()
        adam.backward(loss_fn, module, x)
        return torch.cat([p.grad.flatten() for p in module.parameters()])

    step = compiled_as_in_a_run(gradient)
    torch.manual_seed(1)
    eager = gradient(x)
    torch.manual_seed(1)
    assert_close(step(x), eager, "the compiled gradient", atol=1e-6, rtol=1e-5)
    assert eager.norm() > 0.1


def test_a_python_number_the_loss_reads_changed_every_iteration_trains_compiled_as_eager(in_tmp, monkeypatch):
    """A float the loss reads, changed after every iteration (docs recommend a tensor: a resume or a CUDA graph would
    miss it), is an input of the compiled gradient step after one recompilation: the compiled run equals eager. Before
    (torch.func.grad compiled), every new value compiled a new graph until the limit ended the run; with --num-seeds
    it still does (test_modifications.py::test_what_stops_compilation_ends_the_run_in_one_line)."""
    module, schedule = import_script("ppo_cartpole_gpu"), {"ent_coef": 0.01}
    real_loss, real_log = module.ppo_loss, module.Run.log

    def loss_fn(agent, args, batch):
        loss, stats = real_loss(agent, args, batch)
        return loss - schedule["ent_coef"] * 100 * stats["losses/entropy"], stats

    def log(self, *args, **kwargs):
        schedule["ent_coef"] *= 0.5
        return real_log(self, *args, **kwargs)

    monkeypatch.setattr(module, "ppo_loss", loss_fn)
    monkeypatch.setattr(module.Run, "log", log)
    agents, flags = [], dict(SMALL, total_timesteps=16 * 8 * 5, num_minibatches=2)
    for compile in (False, True):
        schedule["ent_coef"] = 0.01
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=2):
            agents.append(module.train(module.Args(seed=3, **flags, compile=compile)))
    assert_same_agents(agents[1], agents[0], "compiled", atol=2e-4, rtol=1e-3)
