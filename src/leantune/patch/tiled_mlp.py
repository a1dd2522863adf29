"""Tiled MLP: a decoder layer's MLP run over token tiles, so only one tile's [tile, intermediate] tensors are alive.

An MLP block ``y = down(act(gate(x)) * up(x))`` (with or without LoRA on its projections, fused by
``ops.lora_mlp`` or not) acts on each token independently. Over ``N`` tokens its autograd graph keeps several
[N, intermediate] tensors (gate and up outputs, their product, LoRA's [N, r] terms), which at long context are the
largest tensors of the layer being recomputed (docs/design.md, "Saved and recomputed"). :class:`TiledMLPFunction`
cuts the ``N = B * S`` tokens (batch and sequence flattened) into tiles of ``tile_tokens`` rows:

- forward: each tile runs ``forward(x_tile)`` under ``no_grad`` and its output is written into one [N, out] result;
  only ``x`` is saved, plus the RNG state before each tile (small CPU tensors, kept on ctx as torch.utils.checkpoint
  keeps its own), so dropout masks can be drawn again.
- backward: for each tile the RNG state is restored (``torch.random.fork_rng``), the tile is recomputed with grad
  enabled (under the forward's autocast state) and ``torch.autograd.grad`` takes its slice of dY: dX is written per
  tile; parameter gradients (LoRA A/B, any trainable parameter of the module) are summed over tiles, in fp32 for
  half-precision parameters, and returned as the Function's gradients (never written into ``.grad`` directly, so
  ``torch.autograd.grad`` on the loss and DDP's hooks see them as usual).

Numerics: the tiled output and dX rows are the untiled ones exactly when the matmuls give row results independent of
how many rows they get (true of CPU fp32 GEMMs for tile lengths that are multiples of the BLAS row block, not in
general); parameter gradients are summed per tile then across tiles, a different summation order than one GEMM over
all tokens, so they match within rounding, not bit for bit. Dropout draws tile by tile, so its masks differ from an
untiled run's (as any change of shape would) but a tile's recompute reproduces its forward masks exactly.

Inside gradient checkpointing the layer's recompute runs the tiled forward again (no grad inside tiles, same cost
as untiled); the tile length is a fixed keyword (a token count), never derived from free memory (docs/design.md,
"Numerics").

Entry points: :func:`tiled_mlp` (functional: a forward callable, its input and trainable parameters) and
:func:`enable_tiled_mlp` / :func:`disable_tiled_mlp`, which give each MLP module of a model an instance forward that
tiles whatever forward the module had (HF's, PEFT's, or leantune's fused one: call it after ``leantune.patch``).
"""

from __future__ import annotations

import contextlib
import importlib

import torch
from torch import nn

from ..ops import _runtime
from ._model import hf_model
from .families import FAMILIES, family_for
from .forwards import STATE_ATTR

TILE_TOKENS = 4096  # default tile: [4096, 14336] bf16 is 112 MiB per intermediate tensor at Llama-3-8B shape


def check_tile_tokens(tile_tokens, name: str = "tile_tokens") -> None:
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"{name} must be an int >= 1 (tokens per tile), got {tile_tokens!r}")


def _autocast_states(device_type: str) -> list[tuple[str, bool, torch.dtype, bool]]:
    """The autocast state of ``device_type`` (and of the CPU, which torch tracks separately) to re-enter later."""
    states = []
    for kind in dict.fromkeys((device_type, "cpu")):
        if torch.amp.is_autocast_available(kind):
            states.append((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind),
                           torch.is_autocast_cache_enabled()))
    return states


def _rng_state(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _restored(rng, device: torch.device, autocast_states):
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"), \
            contextlib.ExitStack() as stack:
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], device)
        for kind, enabled, dtype, cache in autocast_states:
            stack.enter_context(torch.amp.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache))
        yield


class TiledMLPFunction(torch.autograd.Function):
    """``forward(x)`` over token tiles with per-tile recompute in backward (see the module docstring).

    ``apply(forward, tile_tokens, x, *params)``: ``forward`` maps [..., T, H] to [..., T, out] token-wise; ``x``
    [..., H]; ``params`` the trainable tensors ``forward`` reads (their gradients are returned).
    """

    @staticmethod
    def forward(ctx, forward, tile_tokens, x, *params):
        tokens = x.reshape(-1, x.shape[-1])
        n = tokens.shape[0]
        lead = (1,) * (x.dim() - 2)  # tiles keep x's rank: [1, T, H] for [B, S, H]
        bounds = [(start, min(start + tile_tokens, n)) for start in range(0, n, tile_tokens)]
        rng_states, out = [], None
        for start, end in bounds:
            rng_states.append(_rng_state(x.device))
            y = forward(tokens[start:end].view(*lead, end - start, tokens.shape[1]))
            if out is None:
                out = _runtime.empty((n, y.shape[-1]), dtype=y.dtype, device=y.device)
            out[start:end] = y.reshape(end - start, -1)
        ctx.save_for_backward(x)
        ctx.forward, ctx.bounds, ctx.lead, ctx.rng_states = forward, bounds, lead, rng_states
        ctx.params = params  # parameters themselves (leaves), not activations: the grads are taken against them
        ctx.autocast_states = _autocast_states(x.device.type)
        return _runtime.distinct_output(out.view(*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        tokens = x.reshape(-1, x.shape[-1]).detach()
        grad_tokens = grad_out.reshape(tokens.shape[0], -1)
        need_x = ctx.needs_input_grad[2]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[3:]) if need]
        grad_x = _runtime.empty(tokens.shape, dtype=tokens.dtype, device=tokens.device) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        for (start, end), rng in zip(ctx.bounds, ctx.rng_states):
            with _restored(rng, x.device, ctx.autocast_states), torch.enable_grad():
                x_tile = tokens[start:end].view(*ctx.lead, end - start, tokens.shape[1]).requires_grad_(need_x)
                y_tile = ctx.forward(x_tile)
            inputs = ([x_tile] if need_x else []) + [ctx.params[i] for i in wanted]
            grads = torch.autograd.grad(y_tile, inputs, grad_tokens[start:end].view_as(y_tile), allow_unused=True)
            if need_x:
                grad_x[start:end] = grads[0].reshape(end - start, -1)
                grads = grads[1:]
            for j, g in enumerate(grads):
                if g is None:
                    continue
                if g.dtype in (torch.float16, torch.bfloat16):
                    g = g.float()  # sum half-precision parameter grads over tiles in fp32
                sums[j] = g if sums[j] is None else sums[j].add_(g)
        param_grads = [None] * len(ctx.params)
        for j, i in enumerate(wanted):
            if sums[j] is not None:
                param_grads[i] = sums[j].to(ctx.params[i].dtype)
        return (None, None, grad_x.view_as(x) if need_x else None, *param_grads)


def tiled_mlp(forward, x: torch.Tensor, params=(), *, tile_tokens: int = TILE_TOKENS) -> torch.Tensor:
    """``forward(x)`` computed over tiles of ``tile_tokens`` tokens, recomputed tile by tile in the backward.

    Args:
        forward: a callable acting on each token independently, [..., T, H] -> [..., T, out] (an MLP module's
            ``forward``); it may draw random numbers (dropout): each tile's RNG state is restored in its recompute.
        x: [..., H] input, any float dtype; its tokens (all leading dims flattened) are tiled.
        params: the tensors requiring grad that ``forward`` reads (e.g. the LoRA A/B weights); their gradients,
            summed over tiles, flow back through this call.
        tile_tokens: tokens per tile (the last tile takes the rest); at most this many rows of each intermediate
            tensor are alive at once.

    Returns:
        [..., out], the same as ``forward(x)`` (see the module docstring for when it is bit-identical).

    Raises:
        ValueError: ``tile_tokens`` is not a positive int, or ``x`` has fewer than 2 dims.
    """
    check_tile_tokens(tile_tokens)
    if x.dim() < 2:
        raise ValueError(f"x must be [..., tokens, hidden] with at least 2 dims, got shape {tuple(x.shape)}")
    if x.shape[:-1].numel() <= tile_tokens:
        return forward(x)
    return TiledMLPFunction.apply(forward, tile_tokens, x, *params)


class TiledForward:
    """An MLP module's instance ``forward`` that runs its previous forward through :func:`tiled_mlp`.

    ``previous`` is the instance forward found when tiling was enabled (leantune's fused one, or None for the class
    forward); a previous forward that ``leantune.unpatch`` has since removed is skipped.
    """

    def __init__(self, module: nn.Module, previous, tile_tokens: int):
        self.module, self.previous, self.tile_tokens = module, previous, tile_tokens

    def _inner(self):
        previous = self.previous
        if previous is not None and getattr(previous, "__self__", None) is self.module \
                and STATE_ATTR not in self.module.__dict__:
            previous = None  # the model was unpatched since: its fused forward is gone
        if previous is None:
            return type(self.module).forward.__get__(self.module)
        return previous

    def __call__(self, x, *args, **kwargs):
        inner = self._inner()
        if args or kwargs:  # not a plain token-wise call: leave it alone
            return inner(x, *args, **kwargs)
        params = [p for p in self.module.parameters() if p.requires_grad]
        return tiled_mlp(inner, x, params, tile_tokens=self.tile_tokens)

    def __repr__(self):
        return f"<leantune tiled forward of {type(self.module).__name__}, {self.tile_tokens} tokens per tile>"


def _mlp_modules(model, strict: bool = True) -> list[nn.Module]:
    hf = hf_model(model)
    model_type = getattr(hf.config, "model_type", None)
    if not strict and model_type not in FAMILIES:  # nothing of an uncovered model type was tiled
        return []
    family = family_for(model_type)
    mlp_cls = None if family.mlp_class is None else getattr(
        importlib.import_module(family.modeling_module), family.mlp_class, None)
    if mlp_cls is None:  # no dense MLP class (Mixtral, gpt-oss): nothing to tile (MoE experts blocks are not tiled)
        return []
    return [m for m in hf.modules() if type(m) is mlp_cls]


def enable_tiled_mlp(model, *, tile_tokens: int = TILE_TOKENS):
    """Run every MLP block of ``model`` over token tiles of ``tile_tokens`` (inputs this short or shorter run
    untiled). Call after ``leantune.patch`` (it wraps the module's current forward); calling again re-tiles.

    Args:
        model: a transformers causal LM of a family in ``leantune.patch.FAMILIES``, or a PEFT wrapper of one.
        tile_tokens: tokens per tile (batch x sequence flattened).

    Returns:
        ``model``.

    Raises:
        ValueError: ``tile_tokens`` is not a positive int, or the model's family is not supported.
    """
    check_tile_tokens(tile_tokens)
    for module in _mlp_modules(model):
        previous = module.__dict__.get("forward")
        if isinstance(previous, TiledForward):
            previous = previous.previous
        module.forward = TiledForward(module, previous, tile_tokens)
    return model


def disable_tiled_mlp(model):
    """Undo :func:`enable_tiled_mlp`: each MLP gets back the forward it had. Returns ``model``."""
    for module in _mlp_modules(model, strict=False):
        forward = module.__dict__.get("forward")
        if isinstance(forward, TiledForward):
            if forward.previous is None:
                del module.forward
            else:
                module.forward = forward.previous
    return model
