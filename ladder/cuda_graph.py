"""--cuda-graph: an iteration's device work recorded once as a CUDA graph and replayed: thousands of launches as one."""

import contextlib
import os
import time
import traceback
import warnings

import torch
import torch.utils._pytree as pytree

from ladder.flags import your_line
from ladder.optim import Adam
from ladder.stacked import place_value, slots, value_at


class HostWatch(torch.overrides.TorchFunctionMode):
    """Call 1's watch (eager only) for a host read, which a graph cannot hold, or a CPU tensor meeting CUDA ones."""

    def __init__(self, graph):
        super().__init__()
        self.graph = graph

    def __torch_function__(self, func, types, args=(), kwargs=None):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = func(*args, **(kwargs or {}))
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        devices = {x.device.type for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        if (syncs or {"cpu", "cuda"} <= devices) and not self.graph.reason:
            why = "it waits for the host" if syncs else "a CPU tensor meets CUDA ones"
            self.graph.reason = f"{why} at {your_line(traceback.extract_stack()[:-1])}"
        for w in caught if not syncs else ():
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return out


class CudaGraph:
    """`fn` (tensors in and out) as a CUDA graph: call 1 runs it, watching for host reads, call 2 records it, later ones
    replay it. What cannot be recorded runs as written, with a note; off a GPU or with --no-cuda-graph, silently."""

    devices = ("cuda",)  # where an iteration is given to a CudaGraph (tests add "cpu": `record` then replays `body`)

    def __init__(self, fn, run):
        self.fn, self.run, self.replay, self.calls, optimizer = fn, run, None, 0, run.optimizer
        self.reason = None if run.args.cuda_graph and run.device.type in self.devices else ""  # None: to be recorded
        if self.reason is None and not isinstance(optimizer, Adam):  # its rates: device tensors a replay reads
            self.reason = f"{type(optimizer).__name__} is not ladder.optim.Adam, whose step a graph can hold"
        elif self.reason is None and run.world_size > 1:
            self.reason = "under torchrun the gradients' all-reduce is not recorded"
        self.slots = slots(run.stateful) if self.reason is None else []  # the state's places: buffers, envs' attributes

    def __call__(self, *args):
        if self.reason == "":  # runs as written
            return self.fn(*args)
        self.calls += 1
        leaves, spec = pytree.tree_flatten(args)
        if self.calls == 2 and self.reason is None:
            self.start_recording(leaves, spec)
        if self.reason:  # said once
            self.run.note(f"--cuda-graph: {self.fn.__name__} runs as written, not as a CUDA graph: {self.reason}")
            self.reason = ""
        fits = lambda x, static: x.shape == static.shape if torch.is_tensor(x) else x is static  # noqa: E731
        if self.replay is None or not all(map(fits, leaves, self.static)):
            first = self.calls == 1 and self.reason is None and self.run.device.type == "cuda"
            with self.warm_up() if first else contextlib.nullcontext():
                return self.fn(*args)
        for x, static in zip(leaves, self.static):
            if torch.is_tensor(x) and x is not static:
                static.copy_(x)
        self.copy_state_in()
        out = self.replay()
        for x, static in zip(leaves, self.static):  # what `fn` wrote into its inputs (not into an env's state held)
            if torch.is_tensor(x) and x is not static and not any(x is held for held in self.static_slots):
                x.copy_(static)
        return pytree.tree_map(lambda x: x.clone() if torch.is_tensor(x) else x, out)

    def copy_state_in(self) -> None:
        """State tensors that `fn` replaced (out of place, a reset) copied into the recorded ones."""
        for place, static in zip(self.slots, self.static_slots):
            if value_at(place) is not static:
                place_value(place, static.copy_(value_at(place)))

    @contextlib.contextmanager
    def warm_up(self):
        """Call 1 on a side stream, as recordings need; a host read in it (torch's own, compiling, aside) stops one."""
        (stream := torch.cuda.Stream()).wait_stream(torch.cuda.current_stream())
        torch.cuda.set_sync_debug_mode("warn")
        try:
            watch = contextlib.nullcontext() if self.run.args.compile else HostWatch(self)
            with torch.cuda.stream(stream), warnings.catch_warnings(record=True) as caught, watch:
                warnings.simplefilter("always")
                yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.current_stream().wait_stream(stream)
        for w in caught:
            if "synchroniz" not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            elif not w.filename.startswith(os.path.dirname(torch.__file__)):
                self.reason = self.reason or f"it waits for the host at {w.filename}:{w.lineno}"

    def start_recording(self, leaves, spec) -> None:
        """Call 2: `fn` recorded (no work done) on copies of the inputs and on the state tensors as they are."""
        start, saved = time.perf_counter(), [(place, value_at(place)) for place in self.slots]
        # an input that is a state tensor (the obs a reset returned) stays that tensor, as in the warm-up: compiled
        # code is specialised on which inputs alias, and would compile again inside the recording (and fail)
        self.static_slots = held = [v for *_, v in saved]
        self.static = [x if any(x is v for v in held) or not torch.is_tensor(x) else x.clone() for x in leaves]
        cuda = self.run.device.type == "cuda"  # a failed recording leaves torch's CUDA generator unusable: a clone
        generator = torch.cuda.default_generators[self.run.device.index or 0] if cuda else None
        rng = generator.clone_state() if cuda else None

        def body():
            out = self.fn(*pytree.tree_unflatten(self.static, spec))
            self.copy_state_in()  # recorded too: a replay leaves the new state where the next one reads it
            return out

        try:
            self.replay = self.record(body)
        except Exception as e:  # a host read or a CPU tensor during the recording, an op CUDA graphs cannot hold
            for place, value in saved:
                place_value(place, value)
            if cuda:
                generator.graphsafe_set_state(rng)
            while e.__context__ is not None:  # the first error: the others followed from it
                e = e.__context__
            self.reason = f"recording it failed ({(str(e).strip() or type(e).__name__).splitlines()[0][:200]})"
            return
        seconds = time.perf_counter() - start
        self.run.clock, self.run.setup["recorded"] = self.run.clock + seconds, seconds
        self.run.note(f"--cuda-graph: recorded {self.fn.__name__} as one CUDA graph in {seconds:.2f} s, not counted")

    def record(self, body):
        """`body`'s kernels recorded as a CUDA graph (nothing runs); returns its replay (the CPU tests: `body`)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = body()
        return lambda: graph.replay() or out  # replay() returns None
