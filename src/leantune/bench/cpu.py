"""``leantune bench cpu``: a LoRA training step on the CPU, HF+PEFT against leantune-patched, in one process pair.

What one invocation measures (the setup of ``make demo``'s steps): a model folder (default: the embedded
SmolLM2-135M-Instruct, :func:`leantune.assets.smollm2_path`) loaded in fp32, PEFT LoRA r16 / alpha 32 on every linear
layer with non-zero B (``init_lora_weights=False``, so every gradient is non-trivial), AdamW on the adapters, a fixed
batch of random tokens (labels = inputs), ``torch.set_num_threads(threads)``.

How: two child processes (``python -m leantune.bench.cpu --child SIDE``), one per side, so each side's peak RSS is its
own. Both build the same model from the same seed, run one untimed step (the agreement step: its loss and LoRA
gradients are written for the parent to compare) and ``warmup`` more, then wait. The parent then asks them for one
timed step at a time, alternating (A B B A ...), so a busy host slows both alike; the figure is the median of
``steps`` steps per side, wall time and process CPU time. A side answers each request with one JSON line on stdout.
Peak RSS is ``ru_maxrss`` of each child after its last step, model load included; the RSS after loading is reported
beside it so the step's own share is visible.

Nothing heavy is imported at module level: the parent imports torch only to compare the two sides' gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .harness import BenchError, GiB, child_env

SIDES = ("hf+peft", "leantune")
MODULE = "leantune.bench.cpu"


# ------------------------------------------------------------------------------------------------------ the child
def _rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _child(side: str, spec: dict, grads_path: str) -> int:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                             init_lora_weights=False, bias="none", task_type="CAUSAL_LM"))
    if side == "leantune":
        import leantune

        leantune.patch(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    generator = torch.Generator().manual_seed(spec["seed"] + 1)
    ids = torch.randint(0, model.config.vocab_size, (spec["batch"], spec["seq"]), generator=generator)
    rss_loaded = _rss_bytes()

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    loss = step()  # the agreement step: gradients before any update
    torch.save({"loss": float(loss.detach()), "grads": {n: p.grad.detach().clone() for n, p in
                                                         model.named_parameters() if p.requires_grad}}, grads_path)
    optimizer.step()
    for _ in range(spec["warmup"]):
        step()
        optimizer.step()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        optimizer.step()
        print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}), flush=True)
    print(json.dumps({"rss_loaded": rss_loaded, "rss_peak": _rss_bytes()}), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------------- the parent
class _Side:
    """One child process and its line protocol (a JSON object per line; ``timeout_s`` bounds every answer)."""

    def __init__(self, side: str, spec: dict, grads_path: Path, log: Path):
        self.side, self.log = side, log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, "--child", side, "--spec", json.dumps(spec), "--grads", str(grads_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=child_env())

    def ask(self, command: str | None, timeout_s: float) -> dict:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise BenchError(f"{self.side}: no answer within {timeout_s:.0f} s (log: {self.log})")
            line = self.proc.stdout.readline()
            if not line:
                tail = " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-3:])[-400:]
                raise BenchError(f"{self.side}: the child process ended early: {tail}")
            if line.startswith("{"):
                return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _grad_error(paths: dict) -> tuple[float, float]:
    """(|loss_a - loss_b| / |loss_b|, ||g_a - g_b|| / ||g_b|| over every LoRA gradient), b = HF+PEFT."""
    import torch

    ours, ref = (torch.load(paths[s]) for s in ("leantune", "hf+peft"))
    if ours["grads"].keys() != ref["grads"].keys():
        raise BenchError("the two sides have different trainable parameters")
    diff = sum(float((ours["grads"][k].double() - g.double()).pow(2).sum()) for k, g in ref["grads"].items())
    norm = sum(float(g.double().pow(2).sum()) for g in ref["grads"].values())
    return abs(ours["loss"] - ref["loss"]) / abs(ref["loss"]), (diff / norm) ** 0.5


def run_cpu_bench(model: str, *, batch: int = 4, seq: int = 256, steps: int = 5, warmup: int = 1, threads: int = 1,
                  seed: int = 0, timeout_s: float = 600.0, log_dir: Path | None = None) -> dict:
    """Run both sides as described in the module docstring; the result as a dict (times in s, RSS in bytes).

    Raises:
        BenchError: a child failed or did not answer within ``timeout_s`` (per answer); the message names its log.
    """
    spec = {"model": str(model), "batch": batch, "seq": seq, "warmup": warmup, "threads": threads, "seed": seed}
    with tempfile.TemporaryDirectory(prefix="leantune-bench-cpu-") as tmp:
        logs = Path(log_dir) if log_dir is not None else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        grads = {s: Path(tmp) / f"grads-{s.replace('+', '-')}.pt" for s in SIDES}
        sides = {}
        try:
            for s in SIDES:  # built one after the other: two loads at once would compete for the cores
                sides[s] = _Side(s, spec, grads[s], logs / f"cpu-{s.replace('+', '-')}.log")
                sides[s].ask(None, timeout_s)
            times = {s: [] for s in SIDES}
            for i in range(steps):
                for s in (SIDES if i % 2 == 0 else SIDES[::-1]):
                    times[s].append(sides[s].ask("step", timeout_s))
            rss = {s: sides[s].ask("done", timeout_s) for s in SIDES}
        finally:
            for side in sides.values():
                side.close()
        loss_error, grad_error = _grad_error(grads)
    result = {"spec": spec, "loss_rel_error": loss_error, "grad_rel_error": grad_error}
    for s in SIDES:
        result[s] = {"wall_s": [t["wall_s"] for t in times[s]], "cpu_s": [t["cpu_s"] for t in times[s]],
                     "median_wall_s": statistics.median(t["wall_s"] for t in times[s]),
                     "median_cpu_s": statistics.median(t["cpu_s"] for t in times[s]), **rss[s]}
    ours, ref = result["leantune"], result["hf+peft"]
    result["time_ratio"] = ours["median_wall_s"] / ref["median_wall_s"]
    result["cpu_time_ratio"] = ours["median_cpu_s"] / ref["median_cpu_s"]
    result["rss_ratio"] = ours["rss_peak"] / ref["rss_peak"]
    return result


def format_result(result: dict) -> str:
    """The printed summary: one line per side, then the ratios and the agreement."""
    spec = result["spec"]
    lines = [f"model {spec['model']}, {spec['batch']} x {spec['seq']} tokens, {spec['threads']} thread(s), "
             f"median of {len(result['hf+peft']['wall_s'])} alternating steps (load average "
             f"{os.getloadavg()[0]:.1f})"]
    for s in SIDES:
        r = result[s]
        lines.append(f"  {s:<9} step {r['median_wall_s']:7.3f} s wall, {r['median_cpu_s']:7.3f} s CPU; peak RSS "
                     f"{r['rss_peak'] / GiB:5.2f} GiB (after loading {r['rss_loaded'] / GiB:5.2f})")
    lines.append(f"  leantune / hf+peft: time {result['time_ratio']:.3f}x (CPU time {result['cpu_time_ratio']:.3f}x), "
                 f"peak RSS {result['rss_ratio']:.3f}x")
    lines.append(f"  agreement: loss {result['loss_rel_error']:.1e}, LoRA gradients {result['grad_rel_error']:.1e} "
                 "(relative)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="child process of `leantune bench cpu`")
    parser.add_argument("--child", choices=SIDES, required=True)
    parser.add_argument("--spec", required=True, help="the run as JSON")
    parser.add_argument("--grads", required=True, help="where to write the agreement step's loss and gradients")
    args = parser.parse_args(argv)
    return _child(args.child, json.loads(args.spec), args.grads)


if __name__ == "__main__":
    sys.exit(main())
