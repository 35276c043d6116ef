"""On a CUDA GPU (every test here is skipped where there is none, as in CI): the tensor CartPole steps as on the CPU,
the hot phases of a rollout and update never wait for the host, the CartPole scripts train eager, compiled, resumed
and under torchrun on cuda, and Brax hands its arrays to torch on the GPU without a copy. docs/benchmarks.md says
when this file last ran on a GPU and what it found."""

import glob
import os
from dataclasses import replace

import pytest
import torch
import torch._dynamo

from conftest import (
    ROOT,
    SCRIPTS,
    assert_close,
    assert_same_agents,
    assert_same_scalars,
    import_script,
    read_json,
    run_dir,
    run_script,
    scalars,
    small_args,
    stopped_and_resumed,
    torchrun,
)
from conftest import train_seeds as train_seeds_of
from test_modifications import adaptive_penalty

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def never_syncing(fn):
    """`fn` run under `torch.cuda.set_sync_debug_mode("error")`: a host sync in it (`.item()`, `.cpu()`, a
    data-dependent shape, `bool()` of a GPU tensor) raises."""

    def call(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return call


def test_the_cartpole_steps_on_cuda_as_on_the_cpu():
    """From the same states and actions, one step on the GPU gives the CPU's observation (float32 and FMA: within
    1e-5), reward and flags; 300 steps, so thousands of episodes end and restart from the same drawn states."""
    P = import_script("ppo_cartpole_gpu")
    cpu, gpu = P.CartPole(4096, "cpu", seed=0), P.CartPole(4096, "cuda", seed=0)
    cpu.reset(), gpu.reset()
    actions, starts = torch.randint(0, 2, (300, 4096)), cpu.draw_initial_states(300, 4096)
    for t in range(300):
        gpu.state = cpu.state.cuda()
        expected = cpu.step(actions[t], starts[t])
        got = gpu.step(actions[t].cuda(), starts[t].cuda())
        assert_close(got[0].cpu(), expected[0], f"obs at step {t}", atol=1e-5, rtol=1e-5)
        for name, a, b in zip(("reward", "terminated", "truncated"), got[1:4], expected[1:4]):
            assert torch.equal(a.cpu(), b), f"{name} at step {t}"


@pytest.mark.parametrize("name", ["ppo_cartpole_gpu", "vpg"])
def test_rollout_batch_and_gradient_steps_never_wait_for_the_host(name, in_tmp, monkeypatch):
    """`torch.cuda.set_sync_debug_mode("error")` turns any host sync (`.item()`, `.cpu()`, a data-dependent shape)
    into an exception: the rollout, the batch preparation and every gradient step of two iterations run under it.
    (REINFORCE's rollout asks the host whether every episode has ended: one read per step, by design.)"""
    module = import_script(name)
    for phase in ("collect_rollout", "make_batch", "gradient_step"):  # what train() runs, as written
        monkeypatch.setattr(module, phase, never_syncing(getattr(module, phase)))
    module.train(small_args(module, device="cuda", total_timesteps=16 * 32 * 2))
    summary = read_json(os.path.join(glob.glob("runs/*")[0], "summary.json"))
    assert summary["status"] == "completed" and summary["device"] == "cuda"


@pytest.mark.parametrize("name", SCRIPTS)
def test_compiled_training_matches_eager_on_cuda(name, in_tmp):
    """As tests/test_compile.py on the CPU: the same weights after 4 iterations, eager and --compile (Triton)."""
    from test_compile import trained

    torch._dynamo.reset()
    eager, compiled = trained(name, in_tmp, device="cuda"), trained(name, in_tmp, device="cuda", compile=True)
    for (key, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        assert a.device.type == "cuda"
        assert_close(a, b, key, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_stopped_run_resumed_on_cuda_equals_one_run(name, in_tmp, monkeypatch):
    """The CUDA generators (the policy's and the envs') are saved and restored: bit for bit the same weights."""
    module = import_script(name)
    whole, resumed, stopped = stopped_and_resumed(module, small_args(module, device="cuda"), in_tmp, monkeypatch)
    assert stopped["status"] == "interrupted" and stopped["iterations"] == 3
    for key, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[key]), key


def test_a_model_trained_on_cuda_is_evaluated_on_the_cpu(tmp_path):
    flags = ["--total-timesteps", "8192", "--num-envs", "128", "--no-progress-bar", "--eval-episodes", "2"]
    trained = run_script("ppo_cartpole_gpu", *flags, "--device", "cuda", "--save-model", "--exp-name", "gpu",
                         cwd=tmp_path)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    (model,) = glob.glob(str(tmp_path / "runs" / "*__gpu__*" / "*.cleanrl_model"))
    evaluated = run_script("ppo_cartpole_gpu", "--eval-only", "--load-model", model, "--device", "cpu",
                           "--eval-episodes", "2", "--exp-name", "cpu", cwd=tmp_path)  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    assert read_json(os.path.join(run_dir(tmp_path, "cpu"), "summary.json"))["status"] == "evaluated"


def test_torchrun_on_one_gpu_trains_with_nccl(tmp_path):
    result = torchrun(os.path.join(ROOT, "ppo_cartpole_gpu.py"), "--device", "cuda", "--total-timesteps", "16384",
                      "--no-progress-bar", "--eval-episodes", "2", "--cuda-graph", cwd=tmp_path, procs=1)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recorded one_iteration as one CUDA graph" in result.stderr  # one rank: nothing to all-reduce
    (path,) = glob.glob(str(tmp_path / "runs" / "*" / "summary.json"))
    summary = read_json(path)
    assert summary["world_size"] == 1 and summary["status"] == "completed"


def test_brax_on_the_gpu_hands_arrays_to_torch_without_a_copy(in_tmp, monkeypatch):
    """JAX on the GPU: an observation reaches torch as the same device memory JAX wrote (DLPack), an action
    reaches JAX as torch's memory, and a rollout of ppo_mujoco_brax.py runs with torch never syncing with the host
    (no `.cpu()`, no `.item()`: `set_sync_debug_mode("error")` would raise)."""
    B = import_script("ppo_mujoco_brax")
    envs = B.BraxVecEnv("inverted_pendulum", "spring", 256, 1000, "cuda", seed=0)
    assert B.import_brax()[0].default_backend() == "gpu"
    envs.reset()
    action = torch.zeros(256, 1, device="cuda")
    assert envs.to_jax(action).unsafe_buffer_pointer() == action.data_ptr()
    assert envs.step(action)[0].device.type == "cuda"
    assert envs.to_torch(envs.state.obs).data_ptr() == envs.state.obs.unsafe_buffer_pointer()  # JAX's memory
    monkeypatch.setattr(B, "collect_rollout", never_syncing(B.collect_rollout))
    args = B.Args(env_id="inverted_pendulum", num_envs=256, num_steps=16, total_timesteps=256 * 16 * 2,
                  eval_episodes=0, progress_bar=False, device="cuda")  # fmt: skip
    B.train(args)
    summary = read_json(os.path.join(glob.glob("runs/*")[0], "summary.json"))
    assert summary["status"] == "completed" and summary["device"] == "cuda"


# --cuda-graph: one CUDA graph per iteration ---------------------------------------------------
def recorded_and_not(module, args, tmp, capsys, **changes):
    """`args` trained with --cuda-graph (experiment "graph") and with --no-cuda-graph ("loop") on cuda; returns the
    two agents and the notes of the recorded run."""
    torch._dynamo.reset()
    graphed = module.train(replace(args, cuda_graph=True, exp_name="graph", **changes))
    notes = [line for line in capsys.readouterr().err.splitlines() if "--cuda-graph" in line]
    torch._dynamo.reset()
    return graphed, module.train(replace(args, cuda_graph=False, exp_name="loop", **changes)), notes


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_recorded_run_equals_the_loop_on_cuda(name, compile, in_tmp, capsys):
    """The iteration (REINFORCE: each rollout chunk) recorded once and replayed gives the loop's scalars, bit for bit:
    the same kernels on the same numbers, the permutations and the dropout-free policy's noise drawn alike."""
    if compile and name != "ppo_cartpole_gpu":
        pytest.skip("compiled: PPO's phases stand for the others' (the same compile_phases)")
    module = import_script(name)
    graphed, loop, notes = recorded_and_not(module, small_args(module, device="cuda"), in_tmp, capsys, compile=compile)
    fn = "collect_rollout" if name == "reinforce" else "one_iteration"
    assert len(notes) == 1 and notes[0].startswith(f"note: --cuda-graph: recorded {fn} as one CUDA graph"), notes
    for key, value in loop.state_dict().items():
        assert torch.equal(value, graphed.state_dict()[key]), key
    assert scalars(run_dir(in_tmp, "graph")) == scalars(run_dir(in_tmp, "loop"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_recorded_run_stopped_and_resumed_equals_one_run_on_cuda(name, in_tmp, monkeypatch):
    """Bit for bit, with a tensor given to `run.start` and changed in place after every iteration (the loss reads it):
    the replays see it change, and the resumed run records again on the restored state."""
    module = import_script(name)
    box = adaptive_penalty(module, monkeypatch)
    whole, resumed, _ = stopped_and_resumed(module, small_args(module, device="cuda", cuda_graph=True), in_tmp,
                                            monkeypatch)  # fmt: skip
    assert box["beta"].item() == 1.5**6
    assert_same_scalars(run_dir(in_tmp, "cut"), run_dir(in_tmp, "whole"))  # first: it says where and what
    for key, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[key]), key


@pytest.mark.parametrize("change", ["item", "target_kl", "cpu_scalar"])
def test_a_host_read_in_the_iteration_runs_it_as_written_with_a_note(change, in_tmp, monkeypatch, capsys):
    """A loss that reads a value back to the host (`.item()`), --target-kl's early stop (a host read per epoch), or a
    CPU scalar tensor in the loss (a recording would keep its value): the warm-up iteration sees it, the run says
    where it is once, and goes on as written: the loop's numbers."""
    module = import_script("ppo_cartpole_gpu")
    real_loss, coef = module.ppo_loss, torch.tensor(1.0)

    def loss_fn(agent, args, batch):
        loss, stats = real_loss(agent, args, batch)
        if change == "cpu_scalar":
            return coef * loss, stats
        return loss * (1.0 if loss.item() == loss.item() else 0.0), stats  # the host read

    if change != "target_kl":
        monkeypatch.setattr(module, "ppo_loss", loss_fn)
    args = small_args(module, device="cuda", target_kl=1e-2 if change == "target_kl" else None)
    graphed, loop, notes = recorded_and_not(module, args, in_tmp, capsys)
    why = "a CPU tensor meets CUDA ones at " if change == "cpu_scalar" else "it waits for the host at "
    assert len(notes) == 1 and f"one_iteration runs as written, not as a CUDA graph: {why}" in notes[0], notes
    assert ("ppo_cartpole_gpu.py" if change == "target_kl" else "test_cuda.py") in notes[0], notes
    for key, value in loop.state_dict().items():
        assert torch.equal(value, graphed.state_dict()[key]), key


def test_brax_records_the_batch_and_the_update_on_cuda(in_tmp, capsys):
    """Brax's envs step in JAX (on the GPU); the batch preparation and the update are one CUDA graph: bit for bit."""
    B = import_script("ppo_mujoco_brax")
    args = B.Args(env_id="inverted_pendulum", num_envs=256, num_steps=16, total_timesteps=256 * 16 * 4,
                  eval_episodes=0, progress_bar=False, device="cuda", target_return=None)  # fmt: skip
    graphed, loop, notes = recorded_and_not(B, args, in_tmp, capsys)
    assert len(notes) == 1 and "recorded learn as one CUDA graph" in notes[0], notes
    for key, value in loop.state_dict().items():
        assert torch.equal(value, graphed.state_dict()[key]), key


def test_atari_records_gae_and_the_update_on_cuda(in_tmp, capsys):
    """EnvPool steps on the host; GAE, the fixed-size masked batch and the update are one CUDA graph: bit for bit."""
    A = import_script("ppo_atari_envpool")
    args = A.Args(env_id="Pong-v5", num_envs=8, num_steps=32, total_timesteps=8 * 32 * 4, eval_episodes=0,
                  progress_bar=False, device="cuda")  # fmt: skip
    graphed, loop, notes = recorded_and_not(A, args, in_tmp, capsys)
    assert len(notes) == 1 and "recorded learn as one CUDA graph" in notes[0], notes
    for key, value in loop.state_dict().items():
        assert torch.equal(value, graphed.state_dict()[key]), key


def test_the_same_seed_trains_alike_in_two_processes_on_cuda(tmp_path):
    """Two processes, one seed, 20 iterations of the defaults on the GPU: the same scalars (before: 475 reached at
    94,208 steps in one process and 98,304 in another)."""
    flags = ["--device", "cuda", "--total-timesteps", "40960", "--target-return", "None", "--eval-episodes", "0",
             "--no-progress-bar", "--cuda-graph"]  # fmt: skip
    for name in ("first", "second"):
        result = run_script("ppo_cartpole_gpu", *flags, "--exp-name", name, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
    assert scalars(run_dir(tmp_path, "first")) == scalars(run_dir(tmp_path, "second"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_stacked_seeds_recorded_equal_stacked_seeds_unrecorded_on_cuda(name, in_tmp, capsys):
    """--num-seeds 2 on cuda: the stacked call recorded once as a CUDA graph and replayed gives each seed the
    scalars and weights of the stacked call run as written, and the seeds differ."""
    from test_many_seeds import folders

    module = import_script(name)
    args = small_args(module, device="cuda", num_seeds=2)
    graphed = train_seeds_of(module, replace(args, cuda_graph=True, exp_name="graph"))
    assert any("--cuda-graph: recorded" in line for line in capsys.readouterr().err.splitlines())
    loop = train_seeds_of(module, replace(args, cuda_graph=False, exp_name="loop"))
    for k in range(2):
        for key, value in loop[k].state_dict().items():
            assert torch.equal(value, graphed[k].state_dict()[key]), f"seed {k + 1}: {key}"
        assert scalars(folders(in_tmp, "graph")[1][k]) == scalars(folders(in_tmp, "loop")[1][k])
    assert not torch.equal(loop[0].actor[0].weight, loop[1].actor[0].weight)


def test_stacked_seeds_compiled_and_recorded_equal_eager_ones_on_cuda(in_tmp, capsys):
    """--num-seeds 2 --compile on cuda: the stacked iteration compiled as one graph, then recorded as a CUDA graph,
    trains each seed as the eager stacked call does, within float tolerance (built with no GPU lent: run here first)."""
    P = import_script("ppo_cartpole_gpu")
    tiny = dict(num_envs=8, num_steps=4, num_minibatches=1, update_epochs=2, total_timesteps=8 * 4 * 8)
    args = small_args(P, device="cuda", num_seeds=2, eval_episodes=0, **tiny)
    eager = train_seeds_of(P, replace(args, cuda_graph=False, exp_name="eager"))
    compiled = train_seeds_of(P, replace(args, compile=True, exp_name="compiled"))
    assert any("--cuda-graph: recorded" in line for line in capsys.readouterr().err.splitlines())
    for k in range(2):
        assert_same_agents(compiled[k], eager[k], "compiled", atol=2e-4, rtol=1e-3)  # seed k + 1


@pytest.mark.parametrize("num_seeds", [1, 2])
def test_the_layernorm_dropout_copy_trains_compiled_as_eager_on_cuda(num_seeds, in_tmp):
    """Issue 64's copy (LayerNorm, tanh, Dropout) compiled and recorded on cuda, one seed and two stacked, against
    eager within float tolerance. On the CPU torch 2.13 reads the masks before drawing them: one seed takes the
    gradient by torch.autograd.grad there, two stacked are refused (ladder/run.py). Should two stacked seeds differ
    here, extend that refusal to cuda (built with no GPU lent: run here first)."""
    from test_layers import LAYERNORM_DROPOUT, recipe_copy

    module = recipe_copy(os.path.join(ROOT, "ppo_cartpole_gpu.py"), str(in_tmp), LAYERNORM_DROPOUT, "layernorm_dropout")
    tiny = dict(num_envs=8, num_steps=4, num_minibatches=1, update_epochs=2, total_timesteps=8 * 4 * 4)
    args = small_args(module, device="cuda", num_seeds=num_seeds, eval_episodes=0, **tiny)
    eager = train_seeds_of(module, replace(args, cuda_graph=False, exp_name="eager"))
    torch._dynamo.reset()
    compiled = train_seeds_of(module, replace(args, compile=True, exp_name="compiled"))
    for k in range(num_seeds):
        assert_same_agents(compiled[k], eager[k], "compiled", atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_cleanrls_update_recorded_on_cuda_equals_the_loop(compile, in_tmp, capsys):
    """docs/modifying.md's "Coming from CleanRL": CleanRL's `loss.backward()` with ladder's Adam, recorded as a CUDA
    graph and replayed (and compiled), against the loop: bit for bit eager, within float tolerance compiled. Built
    with no GPU lent (tests/test_cleanrl.py covers the CPU's emulation): run here first."""
    from recipes import CLEANRL_UPDATE, recipe_copy

    module = recipe_copy(os.path.join(ROOT, "ppo_cartpole_gpu.py"), str(in_tmp), CLEANRL_UPDATE, "cleanrl")
    torch._dynamo.reset()
    graphed, loop, notes = recorded_and_not(module, small_args(module, device="cuda"), in_tmp, capsys, compile=compile)
    assert len(notes) == 1 and notes[0].startswith("note: --cuda-graph: recorded one_iteration as one CUDA graph"), (
        notes
    )
    if compile:
        assert_same_agents(graphed, loop, "compiled", atol=2e-4, rtol=1e-3)
    else:
        assert_same_agents(graphed, loop, "compiled", exact=True)
