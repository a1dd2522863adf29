"""patch.document_attention: packed rows attend per document, exactly as transformers' dense block-diagonal mask,
without any [S, S] tensor; everything else is transformers' SDPA path unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import leantune
from leantune.patch.document_attention import NAME, document_spans, use_document_attention

S = 96


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa", torch_dtype=torch.float64)


def _packed_positions():
    """Row 0: documents of 1, 30, 40 and 25 tokens; row 1: one document of the whole row."""
    lengths = [[1, 30, 40, 25], [S]]
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def _loss_and_grads(model, ids, positions, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=positions, labels=ids, **kwargs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_document_spans():
    assert document_spans(_packed_positions()) == [[(0, 1), (1, 31), (31, 71), (71, 96)], [(0, 96)]]
    # a restart to a non-zero position and a jump both begin a document, as transformers reads them
    assert document_spans(torch.tensor([[5, 6, 7, 0, 1, 9, 10]])) == [[(0, 3), (3, 5), (5, 7)]]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_matches_the_dense_block_diagonal_mask_in_float64(checkpointing):
    torch.manual_seed(0)
    reference = _model()
    model = copy.deepcopy(reference)
    assert use_document_attention(model) is None and model.config._attn_implementation == NAME
    for m in (reference, model):
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 50, (2, S))
    positions = _packed_positions()
    ref_logits, ref_grads = _loss_and_grads(reference, ids, positions)
    with _LargestTensor() as largest:
        logits, grads = _loss_and_grads(model, ids, positions)
    assert (logits - ref_logits).abs().max() <= 1e-12
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max() <= 1e-12 * max(1.0, ref_grads[name].abs().max()), name
    # transformers' path forms the [2, 1, S, S] mask; the per-document one nothing of that size
    assert largest.numel < 2 * S * S
    with _LargestTensor() as dense:
        _loss_and_grads(reference, ids, positions)
    assert dense.numel >= 2 * S * S


def test_a_document_attends_only_to_itself():
    torch.manual_seed(1)
    model = _model().eval()
    use_document_attention(model)
    ids = torch.randint(0, 50, (2, S))
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=_packed_positions()).logits
        alone = model(input_ids=ids[:1, 31:71], position_ids=torch.arange(40)[None]).logits
    assert (packed[0, 31:71] - alone[0]).abs().max() <= 1e-12


def test_other_calls_take_transformers_path_unchanged():
    """A padding mask, no position_ids, and generation with a cache give transformers' SDPA results."""
    torch.manual_seed(2)
    reference = _model().eval()
    model = copy.deepcopy(reference)
    use_document_attention(model)
    ids = torch.randint(0, 50, (2, 20))
    padding = torch.ones(2, 20, dtype=torch.long)
    padding[1, :6] = 0
    with torch.no_grad():
        for kwargs in ({"attention_mask": padding}, {}):
            assert torch.equal(model(input_ids=ids, **kwargs).logits, reference(input_ids=ids, **kwargs).logits)
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=True)
    assert torch.equal(model.generate(ids[:1, :8], **settings), reference.generate(ids[:1, :8], **settings))


def test_transformers_results_wherever_it_would_not_build_the_packed_mask():
    """Exactly transformers' results in the cases it does not read as packed rows, or reads with a cache: packed
    positions beside an all-ones attention mask or a cache (it then attends causally across documents), several new
    tokens on a cache (its causal mask aligned to the cache's end), and one [1, S] row of positions for a batch of 2
    (it expands them)."""
    torch.manual_seed(4)
    reference = _model().eval()
    model = copy.deepcopy(reference)
    use_document_attention(model)
    ids = torch.randint(0, 50, (2, S))
    positions = _packed_positions()
    with torch.no_grad():
        for kwargs in ({"attention_mask": torch.ones(2, S, dtype=torch.long), "use_cache": False},
                       {"use_cache": True}):
            assert torch.equal(model(input_ids=ids, position_ids=positions, **kwargs).logits,
                               reference(input_ids=ids, position_ids=positions, **kwargs).logits), kwargs
        cache, ref_cache = (m(input_ids=ids[:, :60], use_cache=True).past_key_values for m in (model, reference))
        assert torch.equal(model(input_ids=ids[:, 60:], past_key_values=cache, use_cache=True).logits,
                           reference(input_ids=ids[:, 60:], past_key_values=ref_cache, use_cache=True).logits)
        shared = positions[:1]
        got = model(input_ids=ids, position_ids=shared, use_cache=False).logits
        assert got.shape == (2, S, 50)
        assert (got - reference(input_ids=ids, position_ids=shared, use_cache=False).logits).abs().max() <= 1e-12


def test_leantune_patch_keeps_per_document_attention(monkeypatch):
    """leantune's fused layers around it: the same loss as the unpatched per-document model."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setenv("LEANTUNE_BACKEND", "torch")
    torch.manual_seed(3)
    base = _model().float()
    use_document_attention(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    ids = torch.randint(0, 50, (2, S))
    expected = model(input_ids=ids, position_ids=_packed_positions(), labels=ids).loss
    leantune.patch(model)
    got = model(input_ids=ids, position_ids=_packed_positions(), labels=ids).loss
    assert abs(got.item() - expected.item()) <= 1e-5 * abs(expected.item())


def test_models_it_does_not_apply_to():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    eager = _model()
    eager.set_attn_implementation("eager")
    assert use_document_attention(eager) == "the model attends with 'eager', not sdpa"
    windowed = Qwen2ForCausalLM._from_config(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=16), attn_implementation="sdpa")
    assert use_document_attention(windowed) == "the model has sliding-window attention layers"
