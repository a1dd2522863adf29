"""Ctrl-C and SIGTERM: a run checkpoints and exits 128 + the signal, a second signal aborts, cleanups are not cut
short, a replaced run is put back (docs/design.md, "Run folder and signals")."""

from __future__ import annotations

import cli_support
import pytest
from cli_support import files_of, run_cli, train_args

from leantune.cli import main

tiny = cli_support.tiny  # the fixture: a tiny model and chat data


@pytest.mark.parametrize("signum, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_interrupted_train_exits_with_128_plus_the_signal(tiny, tmp_path, monkeypatch, signum, status):
    """Ctrl-C and SIGTERM both checkpoint and stop; the exit status says which, as a shell reports a signal (SIGTERM
    used to exit with 130 too)."""
    import os
    import signal

    import leantune.train as train_package

    real_train = train_package.train

    def train_then_signal(config):
        return real_train(config, progress=False,
                          on_step=lambda step: os.kill(os.getpid(), getattr(signal, signum)) if step == 1 else None)

    monkeypatch.setattr(train_package, "train", train_then_signal)
    out = tmp_path / "run"
    assert main([str(a) for a in train_args(tiny, out, "--max-steps", "2")]) == status
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]


def test_second_signal_aborts_with_128_plus_that_signal(tiny, tmp_path, monkeypatch, capsys):
    """A second SIGTERM aborts at once; the status names that signal as for the first (143, not 130)."""
    import os
    import signal

    import leantune.train as train_package

    real_train = train_package.train

    def twice(step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train_package, "train", lambda config: real_train(config, progress=False, on_step=twice))
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "run", "--max-steps", "2"))
    assert code == 143 and "leantune: aborted" in err


def test_sigterm_before_the_first_checkpoint_puts_the_replaced_run_back(tiny, tmp_path, capsys, monkeypatch):
    """SIGTERM outside the training loop (loading, the first eval) stops like Ctrl-C, exit 143: the replaced run is
    put back and the lock removed (the process used to die with the run hidden in .replaced-* and a stale lock)."""
    import os
    import signal

    from leantune.train import loop, run_folder

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    finished = files_of(out)
    real_evaluate = loop.evaluate

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(*args, **kwargs)

    def outside(signum, frame):  # what the old code let happen: the signal reached the process's own handler
        raise RuntimeError("SIGTERM was not handled by leantune")

    monkeypatch.setattr(loop, "evaluate", terminated)
    previous = signal.signal(signal.SIGTERM, outside)
    try:
        code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite", "--seed", "1"))
        assert signal.getsignal(signal.SIGTERM) is outside  # restored after the run
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and "aborted" in err and "is back in" in err, err
    assert files_of(out) == finished and not (out / run_folder.LOCK).exists()


def test_a_second_signal_during_the_put_back_does_not_cut_it_short(tiny, tmp_path, capsys, monkeypatch):
    """Ctrl-C before the first checkpoint puts the replaced run back; a second Ctrl-C during that cleanup is only
    noted (handlers, not a signal mask: a mask covers one thread and torch runs several)."""
    import os
    import signal

    from leantune.train import loop, run_folder

    out = tmp_path / "out"
    code, err = run_cli(capsys, *train_args(tiny, out))
    assert code == 0, err
    finished = files_of(out)
    real_put_back = run_folder.put_back

    def second_signal_in_cleanup(*args):
        os.kill(os.getpid(), signal.SIGINT)
        return real_put_back(*args)

    def first_signal(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "evaluate", first_signal)
    monkeypatch.setattr(run_folder, "put_back", second_signal_in_cleanup)
    code, err = run_cli(capsys, *train_args(tiny, out, "--overwrite", "--seed", "1"))
    monkeypatch.undo()
    assert code == 130 and files_of(out) == finished and not list(out.glob(".replaced-*")), err


def test_sigterm_during_the_last_checkpoint_finishes_the_run(tiny, tmp_path, capsys, monkeypatch):
    import os
    import signal

    from leantune.train import checkpoint

    real_save = checkpoint.save_checkpoint

    def terminated_in_the_last_save(output, step, *args, **kwargs):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(output, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", terminated_in_the_last_save)
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "last", "--save-every", "0"))
    assert code == 0 and (tmp_path / "last" / "summary.json").is_file(), err
