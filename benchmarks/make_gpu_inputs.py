"""Build .gpu/ (git-ignored, carried to the device machine): Llama-3-8B, Llama-3-70B and Llama-3.2-1B shaped config
folders (the 8B and 1B ones with SmolLM2's tokenizer beside them), the MoE ones Mixtral-8x7B, Qwen3-30B-A3B and gpt-oss-20b
(configs only: the benchmarks draw random weights on the card; shapes from the models' published config.json), and
a 2,500-conversation chitchat subset. Run
here (CPU) from the repo root:

    .venv/bin/python benchmarks/make_gpu_inputs.py
"""
import importlib.util
import json
import shutil
from pathlib import Path

from transformers import GptOssConfig, LlamaConfig, MixtralConfig, Qwen3MoeConfig

from leantune import assets

OUT = Path(".gpu")
COMMON = dict(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
              max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, tie_word_embeddings=False),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       tie_word_embeddings=False),
    "llama32-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                       tie_word_embeddings=True),
}

MOE = {
    "mixtral-8x7b": MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
        max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None, router_aux_loss_coef=0.02,
        output_router_logits=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "qwen3-30b-a3b": Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6,
        max_position_embeddings=40960, rms_norm_eps=1e-6, router_aux_loss_coef=0.001, output_router_logits=True,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # gpt-oss-20b's published config (its MXFP4 experts drawn here as bf16): sinks, alternating 128-token windows
    "gpt-oss-20b": GptOssConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=4096),
        max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True, router_aux_loss_coef=0.9,
        output_router_logits=False, tie_word_embeddings=False, pad_token_id=199999, eos_token_id=200002),
}
for name, config in MOE.items():
    config.save_pretrained(OUT / name)

tokenizer_dir = Path(assets.smollm2_path())
for name, shape in SHAPES.items():
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**{**COMMON, **shape}).save_pretrained(folder)
    if name == "llama3-70b":  # benchmarks build it from its config alone; the carry limit is 64 MiB
        continue
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, folder / f)
data = json.loads((Path(importlib.util.find_spec("chitchat_dataset").submodule_search_locations[0])
                   / "dataset.json").read_text())
(OUT / "chitchat.json").write_text(json.dumps({k: data[k] for k in list(data)[:2500]}))
print("wrote", sorted(str(p) for p in OUT.iterdir()))
