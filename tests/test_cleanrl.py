"""docs/modifying.md's "Coming from CleanRL": a copy of ppo_cartpole_gpu.py whose `gradient_step` is CleanRL's
(`loss.backward()` in place of `optimizer.backward(...)`), with ladder's Adam, or torch.optim's SGD with momentum or
RMSprop, in each mode: it trains as the script does, or stops before training in one line that names the change."""

import copy as copy_module
import glob
import inspect
import os
from dataclasses import replace

import pytest
import torch

from conftest import PATHS, ROOT, assert_close, assert_one_error_line, call_main, import_script, run_script, small_args
from ladder.stacked import Stacked
from recipes import ADAM_LINE, CLEANRL, CLEANRL_UPDATE, recipe_copy, recipe_diff
from test_graph import replayed_on_the_cpu
from test_many_seeds import stacked_stopped_and_resumed
from test_modifications import SGD, assert_same_training, three_ways
from test_optim import fixed_batch, torch_step

SCRIPT = os.path.join(ROOT, "ppo_cartpole_gpu.py")


def main_of(copy, *flags, cwd, monkeypatch):
    """`python <copy>.py <flags>` by conftest.call_main, its `note:` lines left out (an error is then one line)."""
    monkeypatch.setitem(PATHS, copy.__name__, copy.__file__)
    result = call_main(copy.__name__, *flags, cwd=cwd)
    result.stderr = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("note: "))
    return result


def assert_alike(actual, expected, what: str, **tolerances) -> None:
    """Two agents' parameters and buffers, each within `tolerances` (none: bit for bit)."""
    theirs = expected.state_dict()
    for name, value in actual.state_dict().items():
        assert_close(value, theirs[name], f"{what}: {name}", **(tolerances or dict(atol=0.0, rtol=0.0)))


SHORT = ["--num-envs", "32", "--num-steps", "16", "--total-timesteps", "1024", "--eval-episodes", "0"]
SHORT += ["--no-progress-bar", "--target-return", "None"]


def test_cleanrls_update_with_ladders_adam_trains_as_the_script_compiled_and_resumed(in_tmp, monkeypatch):
    """`loss.backward()` fills the `.grad` that ladder's Adam steps on, eager (as the script's optimizer.backward, to
    float rounding), compiled (within the compiled-vs-eager tolerance) and stopped-then-resumed (bit for bit). The
    compiled run is a process of its own: torch 2.13's traced `loss.backward()` leaves dynamo unable to compile some
    later functions in the same process (`AssertionError: agent missing`), which a user's one run never meets."""
    copy = recipe_copy(SCRIPT, str(in_tmp), CLEANRL_UPDATE, "cleanrl")
    script = import_script("ppo_cartpole_gpu")
    ours = script.train(small_args(script, eval_episodes=0, exp_name="ours"))
    eager, _, resumed = three_ways(copy, monkeypatch, in_tmp, script="ppo_cartpole_gpu", compile=False)
    assert_alike(eager, ours, "loss.backward() against optimizer.backward", atol=1e-5, rtol=1e-4)
    flags = ["--num-envs", "32", "--num-steps", "16", "--total-timesteps", str(32 * 16 * 6), "--eval-episodes", "0"]
    flags += ["--num-minibatches", "2", "--target-return", "None", "--no-progress-bar", "--compile", "--save-model"]
    flags += ["--exp-name", "compiled"]  # (small_args' run, from the command line)
    monkeypatch.setitem(PATHS, copy.__name__, copy.__file__)
    result = run_script(copy.__name__, *flags, cwd=in_tmp, env={"PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr
    compiled = copy.Agent(4, 2)
    compiled.load_state_dict(torch.load(glob.glob(str(in_tmp / "runs" / "*__compiled__*" / "*.cleanrl_model"))[0]))
    assert_same_training(eager, compiled, resumed)


def test_cleanrls_update_with_ladders_adam_replays_as_a_cuda_graph(in_tmp, monkeypatch, capsys):
    """The CUDA graph's CPU emulation records CleanRL's update and replays it: the loop's weights, bit for bit."""
    copy = recipe_copy(SCRIPT, str(in_tmp), CLEANRL_UPDATE, "cleanrl")
    args = small_args(copy, eval_episodes=0, cuda_graph=True)
    plain = copy.train(replace(args, exp_name="plain"))
    replayed_on_the_cpu(copy, monkeypatch)
    replayed = copy.train(replace(args, exp_name="replayed"))
    assert "note: --cuda-graph: recorded one_iteration as one CUDA graph" in capsys.readouterr().err
    assert_alike(replayed, plain, "replayed")


def test_cleanrls_update_under_num_seeds_stops_in_one_line_naming_optimizer_backward(in_tmp, monkeypatch):
    """vmap cannot run `loss.backward()`: the run stops at the first iteration in one line that says what to write."""
    copy = recipe_copy(SCRIPT, str(in_tmp), CLEANRL_UPDATE, "cleanrl")
    result = main_of(copy, *SHORT, "--num-seeds", "2", cwd=in_tmp, monkeypatch=monkeypatch)
    assert_one_error_line(result, "loss.backward() cannot run vmapped: take the gradient with optimizer.backward(")


def test_a_torch_optimizer_with_cleanrls_update_trains_eager_and_is_refused_in_one_line_elsewhere(in_tmp, monkeypatch):
    """torch.optim's SGD with momentum, its rate a tensor that --anneal-lr sets in place: eager it trains (the weights
    move, the losses are finite); --compile stops at its first iteration (torch's zero_grad is one dynamo will not
    trace) and --num-seeds at its start (vmap needs ladder's Adam), each in one line."""
    copy = recipe_copy(SCRIPT, str(in_tmp), CLEANRL["torch.optim.SGD"], "cleanrl_torch_sgd")
    torch.manual_seed(1)
    before = torch.cat([p.detach().flatten() for p in copy.Agent(4, 2).parameters()])
    after = torch.cat([p.detach().flatten() for p in copy.train(small_args(copy, eval_episodes=0)).parameters()])
    assert torch.isfinite(after).all() and (after - before).abs().max() > 1e-3
    compiled = main_of(copy, *SHORT, "--compile", cwd=in_tmp, monkeypatch=monkeypatch)
    assert_one_error_line(compiled, "--compile: torch.optim's zero_grad is one dynamo will not compile: use ladder")
    stacked = main_of(copy, *SHORT, "--num-seeds", "2", cwd=in_tmp, monkeypatch=monkeypatch)
    assert_one_error_line(stacked, "must be ladder.optim.Adam")


def test_a_torch_optimizer_with_a_float_rate_is_told_to_make_it_a_tensor_or_pass_no_anneal_lr(in_tmp, monkeypatch):
    """CleanRL's `torch.optim.AdamW(agent.parameters(), lr=args.learning_rate)`: --anneal-lr sets the rate in place,
    so the run stops at its start in one line saying what to write (it raised AttributeError in the loop before);
    with --no-anneal-lr it trains."""
    cleanrls = "            optimizer = torch.optim.AdamW(agent.parameters(), lr=args.learning_rate)\n"
    copy = recipe_copy(SCRIPT, str(in_tmp), CLEANRL_UPDATE + [(ADAM_LINE, cleanrls)], "cleanrl_float_rate")
    refused = main_of(copy, *SHORT, cwd=in_tmp, monkeypatch=monkeypatch)
    assert_one_error_line(refused, "--anneal-lr sets AdamW's rate in place: give it a tensor, lr=torch.tensor(")
    assert not glob.glob(str(in_tmp / "runs" / "*" / "events.*")), "refused before training"
    trained = main_of(copy, *SHORT, "--no-anneal-lr", cwd=in_tmp, monkeypatch=monkeypatch)
    assert trained.returncode == 0, trained.stderr


def test_cleanrls_float_rate_annealing_is_told_to_set_the_rate_in_place_in_every_mode(in_tmp, monkeypatch):
    """CleanRL's `param_groups[0]["lr"] = frac * lr` puts a number where ladder's Adam keeps a tensor: eager it
    trained, compiled it ended in inductor's `LoweringException: KeyError: 'unbacked_bindings'` (naming
    ladder/optim.py), and a CUDA graph would replay the first rate (a user's trial). Each mode now stops at the first
    step in one line that says what to write."""
    anneal = '                group["lr"].copy_((1.0 - (iteration - 1.0) / num_iterations) * group["first_lr"])\n'
    cleanrls = '                group["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate\n'
    copy = recipe_copy(SCRIPT, str(in_tmp), [(anneal, cleanrls)], "cleanrl_anneal")
    for flags in ([], ["--compile"]):
        result = main_of(copy, *SHORT, *flags, cwd=in_tmp, monkeypatch=monkeypatch)
        assert_one_error_line(result, 'group["lr"] = 0.005, a number: set the rate in place, group["lr"].fill_(...)')


@pytest.mark.parametrize("name", ["SGD", "RMSprop"])
def test_an_optimizer_written_on_ladders_flat_vector_steps_as_torchs(name, tmp_path):
    """The recipes' SGD with momentum and RMSprop, subclasses of ladder's Adam with a step of their own, take the
    steps torch.optim's take (the script's gradient_step against backward, clip_grad_norm_ and torch's step)."""
    copy = recipe_copy(SCRIPT, str(tmp_path), CLEANRL[name], f"flat_{name.lower()}")
    torch.manual_seed(0)
    args, agent = copy.Args(max_grad_norm=0.05), copy.Agent(4, 2)
    twin, batch = copy_module.deepcopy(agent), fixed_batch(copy)
    mine = getattr(copy, name)(agent, lr=1e-2, eps=1e-5)
    theirs = dict(
        SGD=lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        RMSprop=lambda p: torch.optim.RMSprop(p, lr=1e-2, eps=1e-5),
    )[name](twin.parameters())
    for _ in range(3):
        idx = torch.randperm(len(batch.obs))[:32]
        copy.gradient_step(agent, mine, copy.ppo_loss, args, batch, idx)
        torch_step(twin, theirs, copy.ppo_loss, args, batch, idx)
    assert_alike(agent, twin, f"{name} against torch.optim's", atol=1e-6, rtol=1e-5)


def test_rmsprop_on_ladders_flat_vector_trains_alike_compiled_resumed_and_stacked(in_tmp, monkeypatch):
    """The RMSprop recipe in every mode: a step of two stacked seeds is each seed's step alone, two stacked seeds
    stopped and resumed equal one run (its squares' average in the checkpoint and in the stack), and compiled trains
    within tolerance of eager, resumed bit for bit."""
    copy = recipe_copy(SCRIPT, str(in_tmp), CLEANRL["RMSprop"], "flat_rmsprop")
    torch.manual_seed(0)
    args, agents, batches = copy.Args(max_grad_norm=0.05), [copy.Agent(4, 2) for _ in range(2)], []
    alone = [copy_module.deepcopy(agent) for agent in agents]
    optimizers = [copy.RMSprop(agent, lr=1e-2, eps=1e-5) for agent in agents]
    batches = [fixed_batch(copy) for _ in agents]
    stack = Stacked([{"agent": agent, "optimizer": optimizer} for agent, optimizer in zip(agents, optimizers)])
    step = lambda batch: copy.gradient_step(agents[1], optimizers[1], copy.ppo_loss, args, batch)  # noqa: E731
    stack.call(step, copy.Batch(*map(torch.stack, zip(*batches))))
    stack.release()
    for agent, twin, batch in zip(agents, alone, batches):
        copy.gradient_step(twin, copy.RMSprop(twin, lr=1e-2, eps=1e-5), copy.ppo_loss, args, batch)
        assert_alike(agent, twin, "a stacked seed's step against its own", atol=1e-6, rtol=1e-5)
    (in_tmp / "stacked").mkdir()
    with pytest.MonkeyPatch.context() as patch:  # (its stop undone for the runs below)
        patch.chdir(in_tmp / "stacked")
        stacked_stopped_and_resumed(copy, small_args(copy, num_seeds=2, eval_episodes=0), in_tmp / "stacked", patch)
    eager, compiled, resumed = three_ways(copy, monkeypatch, in_tmp, script="ppo_cartpole_gpu")
    assert_same_training(eager, compiled, resumed)


@pytest.mark.quick
def test_the_sgd_the_modification_tests_train_is_the_recipes():
    """test_modifications.py's SGD (trained there in every mode, in the three CartPole scripts) is the recipe's."""
    assert inspect.getsource(SGD) in CLEANRL["SGD"][0][1]


@pytest.mark.quick
@pytest.mark.parametrize("recipe", list(CLEANRL))
def test_the_docs_show_coming_from_cleanrl_as_the_tests_make_it(recipe):
    """docs/modifying.md shows CleanRL's update and each optimizer as the diff tests/recipes.py makes (torch's SGD
    without the update's lines, shown once above it)."""
    with open(os.path.join(ROOT, "docs", "modifying.md")) as f:
        docs = f.read()
    shown = docs.split(f"<!-- recipe: {recipe} -->\n```diff\n", 1)[1].split("\n```", 1)[0]
    edits = CLEANRL[recipe][len(CLEANRL_UPDATE) :] if recipe == "torch.optim.SGD" else CLEANRL[recipe]
    assert shown == recipe_diff(SCRIPT, edits)
