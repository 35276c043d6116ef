"""--cuda-graph, on the CPU: each iteration's device work run the way a CUDA graph replays it (on the inputs and the
env's tensors it was recorded on, copied in; the state it changes copied back; outputs cloned), by a `CudaGraph` whose
`record` returns `body` itself, so every replay runs it again over the recorded memory. Scalar for scalar it must
equal the plain loop: what this cannot show (the recording itself, the host-read watch) is tests/test_cuda.py's."""

import os
from dataclasses import replace

import pytest
import torch

from conftest import (
    SCRIPTS,
    assert_same_scalars,
    import_script,
    origin,
    read_json,
    run_dir,
    scalars,
    small_args,
    stopped_and_resumed,
)
from conftest import train_seeds as train_seeds_of
from ladder.cuda_graph import CudaGraph
from ladder.stacked import place_value, value_at
from test_modifications import adaptive_penalty
from test_optim import torch_step


def replayed_on_the_cpu(module, monkeypatch, record=lambda self, body: body) -> None:
    """`train` builds a `CudaGraph` on the CPU too, recording by `record` (by default: replay = run `body`)."""
    monkeypatch.setattr(CudaGraph, "devices", ("cuda", "cpu"))
    monkeypatch.setattr(CudaGraph, "record", record)


def assert_same_run(tmp, a: str, b: str) -> None:
    """Two runs (experiment names) logged the same scalars at the same steps and evaluated alike."""
    assert scalars(run_dir(tmp, a)) == scalars(run_dir(tmp, b))
    summaries = [read_json(os.path.join(run_dir(tmp, name), "summary.json")) for name in (a, b)]
    assert summaries[0]["eval_returns"] == summaries[1]["eval_returns"]


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_an_iteration_replayed_on_its_recorded_memory_equals_the_loop(name, in_tmp, monkeypatch, capsys):
    """PPO and VPG replay the whole iteration (rollout, batch, update), REINFORCE each 10-step rollout chunk (whose
    views into the rollout storage differ at every call: copied in and back), over the env's state tensors recorded
    (REINFORCE's reset between rollouts gives new ones: copied in)."""
    module = import_script(name)
    args = small_args(module, cuda_graph=True)
    plain = module.train(replace(args, exp_name="plain"))
    replayed_on_the_cpu(module, monkeypatch)
    replayed = module.train(replace(args, exp_name="replayed"))
    fn = "collect_rollout" if origin(name) == "reinforce" else "one_iteration"
    assert f"note: --cuda-graph: recorded {fn} as one CUDA graph" in capsys.readouterr().err
    for key, value in plain.state_dict().items():
        assert torch.equal(value, replayed.state_dict()[key]), key
    assert_same_run(in_tmp, "plain", "replayed")


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_replayed_run_stopped_and_resumed_equals_one_run(name, in_tmp, monkeypatch):
    """The resumed run records again on the restored state (the recording comes after `run.start`); with a tensor
    given to `run.start` and changed in place after each iteration (a KL-penalty coefficient the loss reads), which a
    replay must see change: a value the loss had copied at the recording would freeze it."""
    module = import_script(name)
    box = adaptive_penalty(module, monkeypatch)
    replayed_on_the_cpu(module, monkeypatch)
    whole, resumed, stopped = stopped_and_resumed(module, small_args(module, cuda_graph=True), in_tmp, monkeypatch)
    iterations = read_json(os.path.join(run_dir(in_tmp, "cut"), "summary.json"))["iterations"]
    assert stopped["iterations"] == 3 and box["beta"].item() == 1.5**iterations
    assert_same_scalars(run_dir(in_tmp, "cut"), run_dir(in_tmp, "whole"))  # first: it says where and what
    for key, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_compiled_phases_replayed_equal_the_compiled_loop(in_tmp, monkeypatch):
    """With --compile the compiled rollout, batch and one-graph gradient step run inside the recording. summary.json
    breaks the set-up down: built (to `run.start`), compiled (iteration 1), recorded (the graph)."""
    module = import_script("ppo_cartpole_gpu")
    args = small_args(module, cuda_graph=True, compile=True)
    torch._dynamo.reset()
    module.train(replace(args, exp_name="plain"))
    replayed_on_the_cpu(module, monkeypatch)
    module.train(replace(args, exp_name="replayed"))
    assert_same_run(in_tmp, "plain", "replayed")
    for name, parts in (("plain", {"built", "compiled"}), ("replayed", {"built", "compiled", "recorded"})):
        summary = read_json(os.path.join(run_dir(in_tmp, name), "summary.json"))
        assert set(summary["setup_parts"]) == parts and summary["setup_parts"]["compiled"] > 0, summary
        assert summary["setup_seconds"] == pytest.approx(sum(summary["setup_parts"].values()), abs=2e-3)


def test_brax_replays_the_batch_and_the_update(in_tmp, monkeypatch):
    """Brax's envs step in JAX: the batch preparation and the update are what it records, on the rollout buffers."""
    module = import_script("ppo_mujoco_brax")
    args = module.Args(env_id="inverted_pendulum", num_envs=16, num_steps=8, num_minibatches=2, device="cpu",
                       total_timesteps=16 * 8 * 3, target_return=None, progress_bar=False, eval_episodes=0,
                       cuda_graph=True)  # fmt: skip
    module.train(replace(args, exp_name="plain"))
    replayed_on_the_cpu(module, monkeypatch)
    module.train(replace(args, exp_name="replayed"))
    assert_same_run(in_tmp, "plain", "replayed")


@pytest.mark.parametrize("async_envs", [False, True])
def test_atari_replays_gae_and_the_update_on_its_fixed_size_batch(async_envs, in_tmp, monkeypatch, capsys):
    """EnvPool steps on the host: GAE, the batch (the reset steps kept, masked) and the update are what Atari records,
    on the rollout's tensors; with the scripted pool, episodes end inside every rollout."""
    from test_atari import fake_make_env

    module = import_script("ppo_atari_envpool")
    monkeypatch.setattr(module, "make_env", fake_make_env(period=5))
    monkeypatch.setattr(module, "atari_game_rule", lambda env_id: (True, ""))
    args = module.Args(env_id="Fake-v5", num_envs=6, num_steps=8, total_timesteps=6 * 8 * 4, num_minibatches=2,
                       update_epochs=2, async_envs=async_envs, eval_episodes=0, progress_bar=False, device="cpu",
                       channels_last=False)  # fmt: skip
    plain = module.train(replace(args, exp_name="plain"))
    replayed_on_the_cpu(module, monkeypatch)
    replayed = module.train(replace(args, exp_name="replayed"))
    assert "note: --cuda-graph: recorded learn as one CUDA graph" in capsys.readouterr().err
    for key, value in plain.state_dict().items():
        assert torch.equal(value, replayed.state_dict()[key]), key
    assert_same_run(in_tmp, "plain", "replayed")


@pytest.mark.parametrize("trouble", ["sgd", "recording fails"])
def test_what_cannot_be_recorded_runs_as_written_with_one_note(trouble, in_tmp, monkeypatch, capsys):
    """A copy's optimizer of torch's (SGD, stepped after backward(): its learning rate would be frozen into the graph),
    or a recording that fails (here: as a host read in it would, on a GPU): the iteration
    runs as written, the run says why once, and its numbers are the plain loop's (a failed recording leaves the env's
    tensors as they were)."""
    module = import_script("ppo_cartpole_gpu")
    if trouble == "sgd":
        sgd = lambda agent, lr, eps: torch.optim.SGD(agent.parameters(), lr=torch.tensor(lr))  # (train() anneals
        monkeypatch.setattr(module, "Adam", sgd)  # the rate in place)
        monkeypatch.setattr(module, "gradient_step", torch_step)
    args = small_args(module, cuda_graph=True)
    module.train(replace(args, exp_name="plain"))

    def failing(self, body):  # as a recording: the env's tensors replaced by ones never computed, then the error
        for place in self.slots:
            place_value(place, torch.full_like(value_at(place), 3))
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    replayed_on_the_cpu(module, monkeypatch, failing if trouble == "recording fails" else lambda self, body: body)
    capsys.readouterr()
    module.train(replace(args, exp_name="replayed"))
    notes = [line for line in capsys.readouterr().err.splitlines() if "--cuda-graph" in line]
    failed = "recording it failed (CUDA error: operation not permitted when stream is capturing)"
    why = {"sgd": "SGD is not ladder.optim.Adam, whose step a graph can hold", "recording fails": failed}
    assert notes == [f"note: --cuda-graph: one_iteration runs as written, not as a CUDA graph: {why[trouble]}"]
    assert_same_run(in_tmp, "plain", "replayed")


@pytest.mark.behaviour
@pytest.mark.parametrize("name", SCRIPTS)
def test_two_stacked_seeds_replayed_equal_the_stacked_call_as_written(name, in_tmp, monkeypatch, capsys):
    """--num-seeds 2: the stacked (vmapped) call inside a `CudaGraph`, replayed on the CPU over its recorded memory,
    gives each seed the scalars and weights of the stacked call run as written."""
    from test_many_seeds import folders

    module = import_script(name)
    args = small_args(module, num_seeds=2, cuda_graph=True)
    plain = train_seeds_of(module, replace(args, exp_name="plain"))
    replayed_on_the_cpu(module, monkeypatch)  # as on a GPU: the stacked call given to a CudaGraph
    replayed = train_seeds_of(module, replace(args, exp_name="replayed"))
    assert " of 2 seeds as one CUDA graph" in capsys.readouterr().err
    for k in range(2):
        for key, value in plain[k].state_dict().items():
            assert torch.equal(value, replayed[k].state_dict()[key]), f"seed {k + 1}: {key}"
        assert scalars(folders(in_tmp, "plain")[1][k]) == scalars(folders(in_tmp, "replayed")[1][k])
