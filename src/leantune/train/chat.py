"""``leantune chat``: talk to a trained run (``--adapter RUN``, merged as ``leantune export`` merges it) or to any
model leantune can load (``--model PATH``: a Hugging Face folder, such as an export, or a .gguf file).

Each turn is the conversation so far through the tokenizer's chat template (with the generation prompt), then
transformers' ``generate``, the reply streamed to stdout as it is produced (``TextStreamer``, special tokens
skipped). Greedy by default; ``--temperature T > 0`` samples. ``--prompt TEXT`` answers once and exits; without it
an interactive loop reads stdin: an empty line is skipped, ``/reset`` starts a new conversation, ``/exit`` or
end of input ends. The model runs on CUDA in bf16 when there is a GPU, else on the CPU in fp32 (``--device``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LeantuneError
from .metrics import say


@dataclass
class ChatOptions:
    adapter: str | None = None
    model: str | None = None
    prompt: str | None = None
    system: str | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    device: str | None = None

    def check(self) -> None:
        if (self.adapter is None) == (self.model is None):
            raise LeantuneError("chat needs exactly one of --adapter RUN and --model PATH")
        if self.max_new_tokens < 1:
            raise LeantuneError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # also refuses NaN
            raise LeantuneError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.device not in (None, "cpu", "cuda"):
            raise LeantuneError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise LeantuneError("--device cuda: no CUDA device is available")


def load_chat_model(options: ChatOptions):
    """``(model in eval mode on its device, tokenizer)`` for ``options``; LeantuneError for a missing run or model,
    or a tokenizer without a chat template."""
    from .merge import merged_run
    from .model import load_model, load_tokenizer, resolve_model

    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if options.adapter is not None:
        model, tokenizer = merged_run(options.adapter)
        source = options.adapter
    else:
        kind, path = resolve_model(options.model)
        tokenizer = load_tokenizer(kind, path)  # a GGUF file's special tokens as the file names them
        model = load_model(kind, path, dtype, "cpu", 0)
        source = str(path)
    if not getattr(tokenizer, "chat_template", None):
        raise LeantuneError(f"the tokenizer of {source} has no chat template; chat needs one (a base model without "
                            "one can still be tried through transformers' generate on plain text)")
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def stop_tokens(model, tokenizer) -> list[int]:
    """The tokenizer's end-of-sequence id (the one leantune's training appends) and those the model's generation
    config names (an instruct model may end a turn on several)."""
    named = model.generation_config.eos_token_id
    named = [] if named is None else [named] if isinstance(named, int) else list(named)
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return ids + [i for i in named if i not in ids]


def reply(model, tokenizer, messages: list[dict], options: ChatOptions, streamer=None) -> str:
    """Generate the assistant's answer to ``messages`` (role/content dicts); streamed to ``streamer`` when given.
    Returns the answer's text, special tokens skipped."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    inputs = {name: value.to(model.device) for name, value in inputs.items()}
    eos = stop_tokens(model, tokenizer)
    sampling = {"do_sample": True, "temperature": options.temperature} if options.temperature > 0 else \
        {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=options.max_new_tokens, streamer=streamer,
                                eos_token_id=eos, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                                use_cache=True, **sampling)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def chat(options: ChatOptions, stdin=None) -> int:
    """Run ``leantune chat``: one answer to ``options.prompt``, else the interactive loop on ``stdin``."""
    from transformers import TextStreamer

    options.check()
    model, tokenizer = load_chat_model(options)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = [{"role": "system", "content": options.system}] if options.system else []
    if options.prompt is not None:
        reply(model, tokenizer, [*start, {"role": "user", "content": options.prompt}], options, streamer)
        return 0
    stdin = stdin or sys.stdin
    messages = list(start)
    interactive = stdin.isatty()
    if interactive:
        say(f"leantune: chatting with {options.adapter or Path(str(options.model))}; /reset starts over, /exit or "
            "Ctrl-D ends")
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            messages = list(start)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": reply(model, tokenizer, messages, options, streamer)})
