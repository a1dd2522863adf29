"""How ``leantune train`` and ``leantune export`` react to Ctrl-C (SIGINT) and SIGTERM.

- During training steps (``GracefulInterrupt``): the first signal lets the current step finish, saves a checkpoint
  and stops (the CLI exits 128 + the signal's number: 130, 143); a second one raises :class:`Aborted` at once.
  Under a launcher (torchrun sets ``WORLD_SIZE``) a Ctrl-C reaches each rank twice, from the terminal and forwarded
  by torchrun, so the same signal again within ``ECHO_SECONDS`` counts as the first.
- While a command writes files (``TerminateAborts``): SIGTERM raises :class:`Aborted` as Ctrl-C raises
  KeyboardInterrupt, so the command's cleanup runs (a replaced run put back, a half-written export removed) instead
  of the process dying mid-write.
- During such a cleanup (``SignalsDeferred``): both signals are only noted, so a second signal cannot cut the cleanup
  short.

All of them are handlers, not signal masks: Python runs handlers in the main thread whichever thread the kernel
delivers a signal to (torch keeps worker threads that a mask of the main thread would not cover). Only the main
thread can install handlers; elsewhere they are no-ops. On exit each puts the previous handler back (SIG_DFL for
one installed from C, which Python cannot reinstall).
"""

from __future__ import annotations

import os
import signal
import threading
import time

from .metrics import say


class Aborted(KeyboardInterrupt):
    """A second Ctrl-C or SIGTERM: stop at once (``signum`` gives the CLI its exit status, 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _SignalHandlers:
    """Context manager installing ``_handle`` for ``SIGNALS`` and putting the previous handlers back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        raise NotImplementedError

    def __exit__(self, *exc):
        for sig, previous in self.previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        return False


ECHO_SECONDS = 2.0  # a launcher forwards the terminal's signal within milliseconds; a person needs longer


class GracefulInterrupt(_SignalHandlers):
    """First Ctrl-C or SIGTERM (``docker stop``, a scheduler's preemption): ``requested`` is set and the loop
    finishes the current step, saves a checkpoint and stops. A second one: :class:`Aborted`."""

    def __enter__(self):
        self.requested = False
        self.signum = None  # the first signal, for the exit status (128 + signum, as a shell reports it)
        self._first_at = 0.0
        return super().__enter__()

    def _handle(self, signum, frame):
        if self.requested:
            echo = ("WORLD_SIZE" in os.environ and signum == self.signum
                    and time.monotonic() - self._first_at < ECHO_SECONDS)
            if echo:
                return
            raise Aborted(signum)
        self.requested, self.signum, self._first_at = True, signum, time.monotonic()
        say(f"leantune: {signal.Signals(signum).name}: finishing the current step (or the final eval) and saving "
            "(again to abort)")


class TerminateAborts(_SignalHandlers):
    """SIGTERM raises :class:`Aborted` while a command writes files, so that its cleanup runs."""

    SIGNALS = (signal.SIGTERM,)

    def _handle(self, signum, frame):
        raise Aborted(signum)


class SignalsDeferred(_SignalHandlers):
    """Ctrl-C and SIGTERM only noted (not acted on) while a cleanup moves files back. The cleanups this guards run
    while an abort is already under way, so a noted signal changes nothing after them."""

    def __enter__(self):
        self.noted = []
        return super().__enter__()

    def _handle(self, signum, frame):
        self.noted.append(signum)
