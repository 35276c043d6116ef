import contextlib
import difflib
import glob
import hashlib
import importlib
import importlib.util
import inspect
import io
import json
import os
import pathlib
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import fields, replace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ladder.compile import compile_settings  # noqa: E402

SCRIPTS = ["ppo_cartpole_gpu", "vpg", "reinforce"]
"""The scripts that share the tensor CartPole (with --script COPY: the copy alone)."""
COPY: dict[str, str] = {}
"""With `--script COPY`: {the copy's module name: the script it came from}."""
PATHS: dict[str, str] = {}
"""With `--script COPY`: {the copy's module name: its file}."""
ALL_SCRIPTS = SCRIPTS + ["ppo_atari_envpool", "ppo_mujoco_brax"]
"""All five: they share the `Run` class, the CLI skeleton and the summary.json schema."""
SUMMARY_KEYS = {
    "env_id", "exp_name", "seed", "device", "world_size", "status", "total_env_steps", "iterations", "wall_seconds",
    "setup_seconds", "setup_parts", "mean_sps", "episodes", "mean_return_last_100", "solved_threshold",
    "solved_at_step", "solved_at_seconds", "eval_returns", "eval_mean_return", "model_path", "args",
}  # fmt: skip
"""The keys of every script's summary.json."""

# Two threads at most: CI machines have two cores, and small ops get slower with more.
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config):
    """--script COPY: the CartPole script COPY is closest to (by its lines) is the one whose behavioural tests run,
    with COPY in its place; the others' tests and the housekeeping ones (identity, budgets) are deselected."""
    share_jax_compilations(config)
    if not (path := config.getoption("--script")):
        return
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise pytest.UsageError(f"--script {path}: no such file")
    lines = lambda file: pathlib.Path(file).read_text().splitlines()
    like = lambda name: difflib.SequenceMatcher(None, lines(path), lines(os.path.join(ROOT, name + ".py"))).ratio()
    source = max(ALL_SCRIPTS, key=like)
    if source not in SCRIPTS:  # Atari's and Brax's tests run their own envs: a copy of theirs is not a CartPole's
        raise pytest.UsageError(
            f"--script {path}: a copy of {source}.py; --script tests copies of {', '.join(SCRIPTS)}"
        )
    name = os.path.splitext(os.path.basename(path))[0]
    if name in ALL_SCRIPTS:
        raise pytest.UsageError(f"--script {path}: give the copy a name of its own (not {name}.py)")
    COPY[name], PATHS[name], SCRIPTS[:] = source, path, [name]
    sys.path.insert(0, os.path.dirname(path))


def share_jax_compilations(config) -> None:
    """JAX's compiled Brax envs kept on disk, in pytest's cache folder, for every process of the suite (each Brax
    test and its subprocesses compiled the same reset and step again: ~10 s a time on a CPU) and for the next run.
    Set before JAX is imported, read when it is; a folder the user names in JAX_COMPILATION_CACHE_DIR is kept.
    https://docs.jax.dev/en/latest/persistent_compilation_cache.html"""
    if getattr(config, "cache", None) is not None and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(config.cache.mkdir(f"jax-compilations-{cpu_features()}"))


def cpu_features() -> str:
    """A short hash of this CPU's instruction sets, so that a folder moved to another kind of CPU is not read there:
    JAX loads programs compiled for other instruction sets with only a warning ("could lead to ... SIGILL")."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):  # not Linux
        flags = platform.machine() + platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def pytest_report_header(config):
    return [f"testing {PATHS[name]} as a copy of {source}.py" for name, source in COPY.items()]


EXTRAS = {"atari": "envpool", "brax": "brax"}
"""Each optional requirements file (requirements-<extra>.txt) and the package that shows it is installed."""


def missing_extras() -> list[str]:
    return [extra for extra, package in EXTRAS.items() if importlib.util.find_spec(package) is None]


def install_hint(extra: str) -> str:
    """Why an extra's test is skipped, and the pip line that installs it."""
    return f"{EXTRAS[extra]} is not installed: pip install -r requirements-{extra}.txt"


def pytest_collection_modifyitems(config, items):
    """--script: only the tests marked `behaviour`. A CartPole-only install (requirements.txt alone): the Atari and
    Brax tests skipped, naming the extra to install."""
    if COPY:
        keep = [item for item in items if item.get_closest_marker("behaviour") and "[NOTSET]" not in item.nodeid]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = learning_last(keep)
    for extra in missing_extras():
        skip = pytest.mark.skip(reason=install_hint(extra))
        for item in [item for item in items if extra in item.nodeid.lower()]:
            item.add_marker(skip)
    items.sort(key=lambda item: item.get_closest_marker("started_early") is not None)  # they wait: last


STARTED: dict[str, tuple] = {}
"""The `started_early` tests' runs, by test id: (their folder, what the marker's function returned)."""
BACKGROUND: list[subprocess.Popen] = []
"""Every process `start_in_background` started, stopped when the session ends."""


def pytest_collection_finish(session):
    """The runs of each selected `started_early` test start as the session does, in the background: on the cores the
    other tests leave idle (they keep 1.3 of 2 busy, on average), where the test, run last, finds them done."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        marker = item.get_closest_marker("started_early")
        if marker and not item.get_closest_marker("skip"):
            folder = pathlib.Path(tempfile.mkdtemp(prefix="started_early_"))
            try:
                STARTED[item.nodeid] = folder, marker.kwargs["start"](folder)
            except Exception:  # the test starts them itself, and fails with the error there
                shutil.rmtree(folder, ignore_errors=True)


def pytest_sessionfinish(session):
    for process in BACKGROUND:
        if process.poll() is None:  # a test that did not get to wait for it (-x, Ctrl-C)
            process.kill()
            process.wait()
    for folder, _ in STARTED.values():
        shutil.rmtree(folder, ignore_errors=True)


def start_in_background(command: list, **popen) -> subprocess.Popen:
    """`command` at the lowest priority (nice 19, where the OS has it), so the tests in front keep their cores; set as
    it starts, before the threads it makes later, which inherit it."""
    process = subprocess.Popen(command, **popen)
    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, process.pid, 19)
    BACKGROUND.append(process)
    return process


def swap_adam(module, monkeypatch, make) -> None:
    """`module.Adam(...)` made by `make` for a test of optimizers; a copy (`--script`) whose train() builds no
    `Adam(...)`, another optimizer in its place, skips the test, which would not reach that optimizer."""
    if "Adam(" not in inspect.getsource(module.train):
        pytest.skip(f"{module.__name__}.train() builds no Adam(...), which this test replaces")
    monkeypatch.setattr(module, "Adam", make)


@pytest.fixture
def started_early(request, tmp_path):
    """(folder, what the test's `started_early` function returned) for the runs that started with the session; they
    start now where the session did not start them. The test runs last, so its runs are raised to normal priority:
    beside another busy process (a loaded CI machine) nice 19 left them 1% of a core, and the test waited past its
    hour."""
    if request.node.nodeid in STARTED:
        for process in BACKGROUND:
            at_normal_priority(process.pid)
        return STARTED[request.node.nodeid]
    return tmp_path, request.node.get_closest_marker("started_early").kwargs["start"](tmp_path)


def at_normal_priority(pid: int) -> None:
    """Each thread of process `pid` at nice 0 (Linux keeps a nice value per thread); where the OS refuses (raising a
    priority takes root, or CAP_SYS_NICE) or the process has ended, as it was."""
    tasks = f"/proc/{pid}/task"
    for tid in os.listdir(tasks) if os.path.isdir(tasks) else [pid]:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)


def learning_last(items: list) -> list:
    """The tests in their order, those that train to a target (minutes) after the others: a copy that learns more
    slowly meets its probes, modes and modifications first (`-x` stops there). Before, `pytest --script COPY -x` spent
    7 minutes failing a learning test before they ran."""
    return sorted(items, key=lambda item: item.get_closest_marker("learning") is not None)


def origin(name: str) -> str:
    """The script `name` is (a copy under --script: the one it came from)."""
    return COPY.get(name, name)


def retarget(cases: list) -> list:
    """Test cases (script names, or tuples that start with one) as given; with --script COPY, those of the script COPY
    came from, with COPY in its place."""
    if not COPY:
        return cases
    ((copy, source),) = COPY.items()
    script = lambda case: case[0] if isinstance(case, tuple) else case
    return [(copy, *case[1:]) if isinstance(case, tuple) else copy for case in cases if script(case) == source]


def import_script(name: str):
    """Import a training script; for the Brax one, its import helper runs first (it sets MUJOCO_GL, which
    MuJoCo reads once, when brax first imports it), and the test is skipped where brax is not installed."""
    module = importlib.import_module(name)
    if hasattr(module, "import_brax"):
        try:
            module.import_brax()
        except ImportError:
            pytest.skip(install_hint("brax"), allow_module_level=True)
    return module


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in an empty folder so runs/ is written there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_script(script: str, *flags, cwd, timeout: float = 600, env=None, hide=None) -> subprocess.CompletedProcess:
    """Run `python <script>.py <flags>` in `cwd`; with `hide`, as if that package were not installed."""
    path = PATHS.get(script, os.path.join(ROOT, script + ".py"))
    cmd = [sys.executable, path, *flags]
    if hide:
        code = f"import runpy, sys; sys.modules[{hide!r}] = None; sys.argv = {[path, *flags]!r}; "
        code += f"sys.path.insert(0, {os.path.dirname(path)!r}); runpy.run_path({path!r}, run_name='__main__')"
        cmd = [sys.executable, "-c", code]  # as `python path`: its folder first on the path
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def torchrun(*args, cwd, timeout=300, procs: int = 2, env=None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node procs ARGS` in `cwd`, one OpenMP thread per process (`env`: more)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def call_main(script: str, *flags, cwd) -> subprocess.CompletedProcess:
    """`python <script>.py <flags>` in this process: the script's main() with sys.argv set, in `cwd`; its exit code and
    what it printed, as run_script returns them (an interpreter start-up, ~3 s on a 2-core CI machine, saved per call).
    An exception main() lets through fails the test; run_script covers the fresh interpreter."""
    module = import_script(script)
    out, err = io.StringIO(), io.StringIO()
    argv, here, threads = sys.argv, os.getcwd(), torch.get_num_threads()
    command, code = [PATHS.get(script, os.path.join(ROOT, script + ".py")), *flags], 0
    sys.argv = command
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module.main()
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit("error: ..."): Python prints the message and exits with 1
            err.write(e.code + "\n")
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        sys.argv = argv
        os.chdir(here)
        torch.set_num_threads(threads)  # main sets the process's thread count
    return subprocess.CompletedProcess(command, code, out.getvalue(), err.getvalue())


def assert_one_error_line(result: subprocess.CompletedProcess, message: str) -> None:
    """A usage error: exit code 2 and exactly one `error: ...` line containing `message`, no traceback."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def assert_close(actual, expected, name: str, **tolerances) -> None:
    """torch.testing.assert_close with `name` in front of torch's own message, which gives the largest absolute and
    relative differences and where they are (`msg=name` alone would replace that message)."""
    torch.testing.assert_close(actual, expected, msg=lambda message: f"{name}: {message}", **tolerances)


STATE_HINTS = {
    ("compiled", "buffer"): "state an iteration updates that the compiled graph does not keep: a buffer assigned a "
    "new tensor, not updated in place (.copy_(), .add_()), or a 0-dim float64 one, which torch 2.13's compiler drops "
    "where ladder/compile.py's workaround is not in force (docs/modifying.md#compiled-graphs)",
    ("compiled", "parameter"): "the update: a Python value the compiled graph holds fixed (make it a tensor), or "
    "random numbers drawn in another order (docs/modifying.md#compiled-graphs)",
    (
        "resumed",
        "buffer",
    ): "state the checkpoint does not keep, or keeps as another run's (a torchrun rank's, a seed's)",
    ("resumed", "parameter"): "the update: state the loss or the optimizer reads that the checkpoint does not keep",
}
"""What a first difference between two runs' agents most likely points to, by mode and by the kind of state."""


def compiled_as_in_a_run(fn):
    """`fn` as a script's phase is under --compile: ladder's settings (which a run makes), then torch.compile."""
    compile_settings()
    return torch.compile(fn, fullgraph=True)


def assert_same_agents(actual, expected, what: str, exact: bool = False, **tolerances) -> None:
    """Two agents hold the same state: bit for bit (`exact`), else within `tolerances`. The buffers are compared first,
    being what a run carries beside its weights (running statistics, coefficients): a failure names the first tensor
    that differs and what `what` ("compiled", "resumed") most likely changed there. Before, a copy's compiled run whose
    statistics went stale failed as `critic.0.weight: Tensor-likes are not close`."""
    buffers = {name for name, _ in expected.named_buffers()}
    mine, theirs = actual.state_dict(), expected.state_dict()
    for name in sorted(theirs, key=lambda name: name not in buffers):  # buffers first, each in its order
        kind = "buffer" if name in buffers else "parameter"
        hint = f"{what}: {name} ({kind}) is the first state that differs; likely {STATE_HINTS[what, kind]}"
        if exact:
            assert torch.equal(mine[name], theirs[name]), f"{hint}: {mine[name]} against {theirs[name]}"
        else:
            assert_close(mine[name], theirs[name], hint, **tolerances)


def read_json(path) -> dict:
    """A JSON file's content, the file closed again (a bare json.load(open(...)) leaks it until collected)."""
    with open(path) as f:
        return json.load(f)


def scalar_tags(run_dir: str) -> set[str]:
    """The tags of the scalars a run folder's event files hold so far."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir)
    events.Reload()
    return set(events.Tags()["scalars"])


def interrupt_after_an_iteration(command: list, cwd, sig: int, env=None, timeout: float = 60):
    """Start `command` in `cwd`, wait until its run under `cwd`/runs has logged an iteration (charts/SPS: its set-up
    is over and its signal handlers are in place), send it `sig` and return how it ended (a CompletedProcess). A
    fixed 3 s after the events file appeared was too short on a busy machine: the signal came during the set-up."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not any("charts/SPS" in scalar_tags(run) for run in glob.glob(os.path.join(str(cwd), "runs", "*"))):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"no iteration logged under {cwd} (exit {proc.returncode}): {err[-2000:]}")
        time.sleep(0.5)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar the run folder's event files hold, SPS aside (a clock, not a result), by tag, in step order:
    the files are read in name order, and two writers of one process in the same second are told apart by a
    counter that sorts as text (".10" before ".9"), so a resumed run's events can come first."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: sorted((e.step, e.value) for e in events.Scalars(tag)) for tag in events.Tags()["scalars"]
            if tag != "charts/SPS"}  # fmt: skip


HINTS = {
    "charts/learning_rate": "the learning rate: a schedule not given to run.start, or state the rate is computed from",
    "losses/": "the update: state the loss or the optimizer reads that the checkpoint does not keep",
    "charts/episodic_": "the episodes: the envs' state or the actions' random numbers",
}
"""What a tag that differs first most likely points to."""


def assert_same_scalars(run: str, one_run: str, what: str = "the resumed run") -> None:
    """Two run folders logged the same scalars at the same steps; else which tag differs first, at which iteration
    and step, by how much, and what that tag most likely points to (before: a diff of two whole dicts)."""
    mine, theirs = scalars(run), scalars(one_run)
    first = []  # each tag's first difference: (step, tag, its value here, in one run)
    for tag in sorted(set(mine) | set(theirs)):
        a, b = dict(mine.get(tag, [])), dict(theirs.get(tag, []))
        differing = [step for step in sorted(set(a) | set(b)) if a.get(step) != b.get(step)]
        if differing:
            first.append((differing[0], tag, a.get(differing[0]), b.get(differing[0])))
    if first:
        step, tag, value, expected = min(first)
        steps = sorted(dict(theirs.get("charts/learning_rate", [])))  # logged at every iteration
        at = f"iteration {steps.index(step) + 1} (step {step:,})" if step in steps else f"step {step:,}"
        cause = next((f"; likely {hint}" for prefix, hint in HINTS.items() if tag.startswith(prefix)), "")
        raise AssertionError(f"{what}'s {tag} differs from one run's at {at}: {value} against {expected}{cause}")


def run_dir(tmp, exp_name: str) -> str:
    """The one run folder under `tmp`/runs of the experiment `exp_name`."""
    (path,) = glob.glob(os.path.join(str(tmp), "runs", f"*__{exp_name}__*"))
    return path


def small_args(module, **flags):
    """Six iterations of 32 envs on the CPU, three evaluation episodes (REINFORCE: rollouts until all episodes end);
    PPO: two minibatches an epoch, so a compiled epoch unrolls two steps, not four (a cold compile takes ~3/4 as long:
    docs/tests.md, "How long")."""
    steps = 500 if origin(module.__name__) == "reinforce" else 16
    total = 16 * 32 * 6 if origin(module.__name__) != "reinforce" else 12_000
    flags = dict(num_envs=32, num_steps=steps, total_timesteps=total, target_return=None, progress_bar=False,
                 eval_episodes=3, device="cpu") | flags  # fmt: skip
    if "num_minibatches" in {f.name for f in fields(module.Args)}:
        flags.setdefault("num_minibatches", 2)
    return module.Args(**flags)


def train_seeds(module, args) -> list:
    """`module.train(args)` with --num-seeds K as main() runs it: each seed's agent (its own objects, built by its pass
    of `for args in run.args_per_run:`, holding its own state after the run)."""
    agents, start = [], module.Run.start

    def recording(self, agent, *rest, **stateful):
        agents.append(agent)
        return start(self, agent, *rest, **stateful)

    module.Run.start = recording
    try:
        agent = module.train(args)
    finally:
        module.Run.start = start
    return agents if len(agents) > 1 else [agent]  # (K runs: --num-seeds, --sweep)


def stop_with_sigterm_at(module, monkeypatch, iteration: int) -> None:
    """Send this process SIGTERM while iteration `iteration` is being logged (Run then stops after it)."""
    real_log = module.Run.log

    def log(self, *args, **kwargs):
        if self.progress.iteration == iteration - 1 and not self.args.resume:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_log(self, *args, **kwargs)

    monkeypatch.setattr(module.Run, "log", log)


def stopped_and_resumed(module, args, tmp, monkeypatch, make_envs=None):
    """`args` trained straight through (experiment "whole"), and stopped by SIGTERM after iteration 3 (experiment
    "cut"), then resumed in its folder; returns (whole's agent, the resumed agent, the stopped run's summary).
    `make_envs()`: fresh envs for each run, given to `train` (the CartPole scripts'; None: the script's own)."""
    train = lambda a: module.train(a) if make_envs is None else module.train(a, make_envs())
    whole = train(replace(args, exp_name="whole"))
    stop_with_sigterm_at(module, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train(replace(args, exp_name="cut"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # Run put the handlers back
    stopped = read_json(os.path.join(run_dir(tmp, "cut"), "summary.json"))
    return whole, train(replace(args, exp_name="cut", resume=run_dir(tmp, "cut"))), stopped


class FakeRun:
    """A W&B run as `wandb.init(reinit="create_new")` returns it: its settings and the rows logged to it."""

    def __init__(self, **settings):
        self.settings, self.rows, self.id, self.finished = settings, [], f"fake-{settings['name']}", False

    def define_metric(self, name, step_metric):
        assert (name, step_metric) == ("*", "global_step")

    def log(self, data):
        self.rows.append(data)

    def finish(self):
        self.finished = True


def fake_wandb(monkeypatch) -> list[FakeRun]:
    """wandb replaced by a stand-in for the test (a video is its path); returns the runs it makes, in order."""
    runs = []
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **settings: runs.append(FakeRun(**settings)) or runs[-1]
    wandb.Video = lambda path, format: path
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    return runs
