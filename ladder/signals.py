"""Ctrl-C and SIGTERM: the run stops after the iteration, with a checkpoint (at once: a second Ctrl-C, or compiling)."""

import signal


class Signals:
    """The run's SIGINT and SIGTERM handlers; `received`: the first signal's number (0: none)."""

    def __init__(self, note, compiling):
        self.note, self.compiling, self.received, self.handlers = note, compiling, 0, {}

    def install(self) -> None:
        self.handlers = {s: signal.signal(s, self.request) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)

    def request(self, signum: int, frame) -> None:
        """Stop at the end of this iteration (a second Ctrl-C: at once), or at once while compiling."""
        if self.compiling():
            self.note(f"{signal.Signals(signum).name} while compiling: stopping now, before the first iteration ends")
            raise KeyboardInterrupt(signum, "while compiling")  # (signum) alone: stopped after an iteration
        self.received = self.received or signum
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C raises KeyboardInterrupt at once
        self.note(f"{signal.Signals(signum).name}: stopping after this iteration (Ctrl-C again: at once)")


def interrupt(signum: int, frame) -> None:
    """SIGTERM as Ctrl-C is, a KeyboardInterrupt at once (before a run's start, in its final evaluation)."""
    raise KeyboardInterrupt(signum, "at once")  # (signum) alone: stopped after an iteration, with a checkpoint
