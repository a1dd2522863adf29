"""The divergence guard of ``leantune train``: when the logged loss and gradient norm say the run is lost.

A run counts as diverged at a logged step when (the thresholds are options, see ``TrainConfig``):

- the train loss or the gradient norm is non-finite (NaN or inf: the update that follows poisons the weights);
- the train loss is above ``--divergence-factor`` (default 4) times the initial eval loss (the held-out loss before
  the first step; a healthy fine-tune stays below it, and a loss that high is worse than where the run began);
- the gradient norm is zero (below fp32's smallest normal number) at ``--zero-grad-steps`` (default 3) logged steps
  in a row: nothing reaches the adapter any more, the state ``--lr 1e6`` leaves (softmax saturated, the loss stuck
  at ln(vocab)). Measured only with clipping on (``--max-grad-norm > 0`` computes the norm).

The guard reads only values the loop already holds on the host at a logging step: it adds no device sync. It
decides the same on every rank (the loss is the global step's, the norm the global one).

Which checkpoint is good: the checkpoint of step c holds the weights after update c, and the loss and norm logged at
step c + 1 are the first measurements of those weights. So a checkpoint is trusted once a later healthy observation
covers it (``c < last_healthy``), and the newest trusted checkpoint is never rotated away (``protected``).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import LeantuneError
from . import checkpoint
from .metrics import say

ZERO_NORM = 2.0 ** -126  # fp32's smallest normal: a norm below it means no gradient reached the adapter


class DivergenceGuard:
    """Feed ``observe(step, loss, grad_norm)`` at each logging step; it returns why the run diverged, or None.

    ``reference``: the initial eval loss (None until known; the first finite train loss stands in when it is never
    set). ``grad_norm=None``: not measured (clipping off).
    """

    def __init__(self, factor: float, zero_grad_steps: int, reference: float | None = None):
        self.factor = factor
        self.zero_grad_steps = zero_grad_steps
        self.reference = reference if reference is not None and math.isfinite(reference) else None
        self.zero_streak = 0
        self.last_healthy = 0  # the last step whose observation was healthy (0: none yet this session)

    def observe(self, step: int, loss: float, grad_norm: float | None) -> str | None:
        """Why the run diverged at ``step`` (one phrase), or None; see the module docstring for the rules."""
        if self.reference is None and math.isfinite(loss):
            self.reference = loss
        reason = None
        if not math.isfinite(loss):
            reason = f"the train loss is {loss}"
        elif grad_norm is not None and not math.isfinite(grad_norm):
            reason = f"the gradient norm is {grad_norm}"
        elif self.factor and self.reference is not None and loss > self.factor * self.reference:
            reason = (f"the train loss {loss:.4g} is above --divergence-factor {self.factor:g} x the initial loss "
                      f"{self.reference:.4g}")
        if grad_norm is not None and math.isfinite(grad_norm) and grad_norm < ZERO_NORM:
            self.zero_streak += 1
            if reason is None and self.zero_grad_steps and self.zero_streak >= self.zero_grad_steps:
                reason = (f"the gradient norm has been zero for {self.zero_streak} logged steps in a row "
                          f"(--zero-grad-steps {self.zero_grad_steps}): nothing reaches the adapter any more")
        else:
            self.zero_streak = 0
        if reason is None and self.zero_streak == 0:
            self.last_healthy = step
        return reason

    def trusted(self, checkpoint_step: int) -> bool:
        """Whether the weights saved at ``checkpoint_step`` were measured healthy by a later logged step."""
        return checkpoint_step < self.last_healthy


def good_checkpoints(output: Path, guard: DivergenceGuard | None) -> list[Path]:
    """The checkpoints of ``output`` whose weights a later logged step measured healthy (all without a guard)."""
    found = checkpoint.checkpoints(output)
    if guard is None:
        return found
    return [p for p in found if guard.trusted(int(p.name.removeprefix("step-")))]


def react(config, output: Path, guard: DivergenceGuard, step: int, why: str, warned: bool) -> bool:
    """A diverged run at ``step``: with ``--divergence stop`` a LeantuneError naming the last good checkpoint (the
    folder keeps every file); with ``warn`` one warning for the run (returns True: warned)."""
    if config.divergence == "warn":
        if not warned:
            say(f"leantune: warning: the run diverged at step {step}: {why}; it goes on (--divergence warn; "
                "non-finite values are recorded as null)")
        return True
    good = good_checkpoints(output, guard)
    kept = (f"its last good checkpoint is {good[-1]} (leantune export --adapter {good[-1]} --out DIR exports it)"
            if good else "no checkpoint was saved before it")
    raise LeantuneError(f"training diverged at step {step}: {why}; the run stopped (--divergence stop) and {kept}; "
                        f"start again with a lower --lr than {config.lr:g} (or --divergence warn to go on)")
