"""leantune.heap: the objects alive at a training loop's start frozen out of Python's full collections, and thawed
after; young garbage still collected; `leantune train` and TRL's trainers (patch_trainer) run their steps frozen."""

from __future__ import annotations

import gc

import pytest
from cli_support import run_cli, tiny, train_args  # noqa: F401  (tiny is a fixture)

from leantune.heap import long_lived_frozen


@pytest.fixture(autouse=True)
def thawed():
    """Each test starts and ends with nothing frozen (gc.freeze is process-wide)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class Node:
    def __init__(self):
        self.other = self  # a reference cycle: only the cyclic collector frees it


def frozen(obj) -> bool:
    return not any(o is obj for o in gc.get_objects())  # the permanent generation is not listed


def test_objects_alive_at_the_start_are_frozen_then_thawed():
    keep = Node()
    with long_lived_frozen():
        assert frozen(keep)
        made_inside = Node()
        assert not frozen(made_inside)
    assert gc.get_freeze_count() == 0 and not frozen(keep)


def test_garbage_made_inside_is_still_collected():
    with long_lived_frozen():
        Node()  # unreachable at once, held only by its own cycle
        assert gc.collect() >= 1
        assert gc.get_freeze_count() > 0


def test_thawed_after_an_exception():
    with pytest.raises(RuntimeError), long_lived_frozen():
        raise RuntimeError("step failed")
    assert gc.get_freeze_count() == 0


def test_nested_blocks_thaw_once_at_the_outermost_end():
    keep = Node()
    with long_lived_frozen():
        with long_lived_frozen():
            pass
        assert frozen(keep)  # the inner block's end did not thaw
    assert not frozen(keep)


def test_a_caller_who_froze_first_keeps_the_freeze():
    """Objects frozen before the block (a launcher's, the caller's): the block still freezes what is alive at its
    start, and thaws nothing at its end (gc cannot thaw only its own)."""
    early = Node()
    gc.freeze()
    before = gc.get_freeze_count()
    keep = Node()
    with long_lived_frozen():
        assert frozen(keep) and frozen(early)
        late = Node()
        assert not frozen(late)
    assert frozen(early) and frozen(keep) and gc.get_freeze_count() > before


def test_train_runs_its_steps_frozen_and_thaws(tiny, tmp_path, capsys, monkeypatch):  # noqa: F811
    import leantune.train as train_package

    seen = []
    real_train = train_package.train
    monkeypatch.setattr(train_package, "train", lambda config: real_train(
        config, progress=False, on_step=lambda done: seen.append(gc.get_freeze_count())))
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", "--max-steps", "2"))
    assert code == 0, err
    assert len(seen) == 2 and all(count > 1000 for count in seen), seen  # the model's objects among them
    assert gc.get_freeze_count() == 0
