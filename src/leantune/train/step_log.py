"""The training loop's reads of its own numbers (docs/design.md, "No host sync in a step").

Each step's loss and gradient norm are copied to pinned host memory without blocking, behind an event; a step's
record (metrics.jsonl, the progress bar) is written once the next step is queued, so the host waits, if at all, for a
step that the device is already past while the next one keeps it busy, and at every point where the host waits anyway
(eval, checkpoint, stop, end). There a loss op's deferred label error is raised as a LeantuneError.
"""

from __future__ import annotations

import time

import torch

from .. import ops
from ..errors import LeantuneError
from .divergence import react

LOG_LAG = 1  # steps whose records wait in flight (module docstring)


class StepLog:
    """Step records of ``run`` (loop._Run) on their way to metrics.jsonl and the progress bar ``bar`` (LOG_LAG).
    On CUDA a step's time is the device's, between events queued at its start and end (the host does not wait for
    it); on the CPU, the host's."""

    def __init__(self, run, bar):
        self.run, self.bar, self.pending, self.warned = run, bar, [], False
        self.cuda = torch.device(run.device).type == "cuda"

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def record(self, done: int, timer, loss, grad_norm, lr: float, tokens: int) -> None:
        values = [v.detach().reshape(()).double() for v in (loss, grad_norm) if torch.is_tensor(v)]
        device = values[0].device if values else torch.device(self.run.device)
        # the loss ops' deferred-error flags travel with the numbers: reading them directly would block on the
        # step just queued
        flags = [flag.double() for flag in ops.deferred_error_flags() if flag.device == device]
        values += flags
        numbers = torch.stack(values) if values else torch.zeros(0, dtype=torch.float64)
        if self.cuda:
            host = torch.empty(numbers.shape, dtype=torch.float64, pin_memory=True)
            host.copy_(numbers, non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            seconds = (timer, end)
        else:
            host, seconds = numbers, time.perf_counter() - timer
        self.pending.append((done, host, seconds, torch.is_tensor(loss), torch.is_tensor(grad_norm), loss, grad_norm,
                             lr, tokens, len(flags)))
        if len(self.pending) > LOG_LAG:
            self.flush(keep=LOG_LAG)

    def flush(self, keep: int = 0) -> None:
        """Write the records of every step but the last ``keep`` (a host wait on their events), and raise a loss
        op's deferred label error (``ops.raise_deferred_errors``) as a LeantuneError."""
        ready, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        run = self.run
        flagged = False
        for done, host, seconds, loss_is_t, norm_is_t, loss, grad_norm, lr, tokens, n_flags in ready:
            if self.cuda:
                seconds[1].synchronize()
                seconds = seconds[0].elapsed_time(seconds[1]) / 1000
            values = host.numpy().tolist()  # host memory: pinned, or the CPU's own tensor
            loss = values.pop(0) if loss_is_t else loss
            grad_norm = values.pop(0) if norm_is_t else grad_norm
            flagged |= any(values[:n_flags])
            run.train_tokens += tokens
            run.train_seconds += seconds
            if run.world.main:
                record = {"type": "train", "step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                          "tokens": tokens, "tokens_per_s": tokens / seconds, "step_seconds": seconds}
                if self.cuda:  # the allocator's counters at the write: read on the host, no sync
                    record["gpu_memory_gib"] = torch.cuda.memory_allocated() / 2**30
                    record["gpu_peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
                run.metrics.log(record)
            # the guard reads the values just written (on the host already): no read of its own
            why = None if run.guard is None else run.guard.observe(
                done, loss, grad_norm if run.config.max_grad_norm > 0 else None)
            if why is not None:
                self.bar.close()
                self.warned = react(run.config, run.output, run.guard, done, why, self.warned)
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens / seconds:.0f}")
        if flagged or (ready and not keep):  # a set flag, or a point where the host waits anyway (keep = 0)
            raise_deferred_errors()


def raise_deferred_errors() -> None:
    try:
        ops.raise_deferred_errors()
    except ValueError as exc:
        raise LeantuneError(f"the loss found a bad label: {exc}") from exc
