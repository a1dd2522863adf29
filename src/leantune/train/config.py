"""Training configuration: one dataclass, filled from defaults, then a TOML file, then command-line flags.

Precedence (lowest to highest): the defaults below, ``--config run.toml`` (keys are the field names, with ``_`` or
``-``), explicit flags. ``leantune train --help`` shows every field with its default (built from this dataclass).
Every value is checked against its field's type before use (``coerce``: no truthy strings for booleans, no floats
for integers) and then for range (``TrainConfig.validate``: e.g. every float finite), so a bad value is reported
before a model is loaded or anything is written.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ..errors import LeantuneError

MAX_SEQ_LEN = 1 << 20  # tokens per packed sequence: beyond any model's context; bigger only exhausts host memory
# --seq-len when none is given, by device type: a CPU step costs time and activation memory in proportion to the
# tokens of a micro-batch (a 1024-token default made a 3-step run of the embedded model take minutes and ~7 GB)
DEFAULT_SEQ_LEN = {"cuda": 1024, "cpu": 256}


@dataclass
class TrainConfig:
    """Every knob of ``leantune train``. Help strings live in ``metadata["help"]`` and feed ``--help``."""

    model: str | None = field(default=None, metadata={"help": "HF model folder, .gguf file, or config.json "
                              "(random init of that shape)"})
    data: str | None = field(default=None, metadata={"help": "JSONL (text | messages | conversations | "
                             "prompt/completion), .json (chitchat format or a list of records), .txt, .parquet, .csv, "
                             ".arrow or a saved dataset folder; several mixed: a.jsonl,b.csv (all of each) or "
                             "a.jsonl:0.7,b.csv:0.3 (by weight)"})
    output: str = field(default="runs/train", metadata={"help": "output directory"})
    max_steps: int | None = field(default=None, metadata={"help": "optimizer steps (overrides --epochs)"})
    epochs: float = field(default=1.0, metadata={"help": "passes over the training split"})
    seq_len: int | None = field(default=None, metadata={"help": "tokens per packed sequence"})
    batch_size: int = field(default=4, metadata={"help": "packed sequences per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (AdamW)"})
    warmup_steps: int | None = field(default=None, metadata={"help": "linear warmup steps before the cosine "
                                     "decay"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "the cosine decay's floor as a fraction of --lr "
                                "(reached one step past the last, as in HF's schedule)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm (0: off)"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (scaling = alpha / r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout probability"})
    dora: bool = field(default=False, metadata={"help": "DoRA (PEFT use_dora: weight-decomposed LoRA, a learned "
                                                        "magnitude per output channel), fused by leantune's ops; "
                                                        "with --quantize PEFT's DoRA forward runs over the "
                                                        "dequantised weight (not fused)"})
    rslora: bool = field(default=False, metadata={"help": "rank-stabilised LoRA: scaling alpha / sqrt(r) instead of "
                                                          "alpha / r (PEFT use_rslora)"})
    target_modules: str = field(default="all-linear", metadata={"help": "all-linear (every linear layer and a MoE "
                                "model's expert stacks), or comma-separated names of linear layers or expert "
                                "stacks (e.g. q_proj,v_proj or gate_up_proj,down_proj)"})
    gradient_checkpointing: str = field(default="off", metadata={"help": "on|off: recompute activations in "
                                        "backward"})
    eval_every: int = field(default=50, metadata={"help": "eval every N steps (0: only at start and end)"})
    eval_size: int = field(default=32, metadata={"help": "held-out packed sequences for eval"})
    save_every: int = field(default=100, metadata={"help": "checkpoint every N steps (0: only the ones "
                                                                "always written: at the last step and on Ctrl-C)"})
    max_examples: int | None = field(default=None, metadata={"help": "use at most N examples of the data file "
                                     "(after a seeded shuffle)"})
    resume: bool = field(default=False, metadata={"help": "continue the run in --output from its last "
                                                          "checkpoint, with its settings (read from its run.json; "
                                                          "options given must agree)"})
    overwrite: bool = field(default=False, metadata={"help": "replace a run already in --output (kept in "
                                                                 "--output/.replaced-* until the new run finishes)"})
    seed: int = field(default=0, metadata={"help": "seed for init, data order and dropout"})
    patch: str = field(default="on", metadata={"help": "on|off: apply leantune.patch (the Triton/fused ops)"})
    device: str | None = field(default=None, metadata={"help": "cpu or cuda"})
    quantize: str | None = field(default=None, metadata={"help": "nf4: store the frozen decoder weights in 4-bit "
                                 "NF4 (QLoRA); fp8 (experimental): in e4m3 with one scale per output channel, the "
                                 "frozen GEMMs in FP8 (needed for a checkpoint that ships FP8 weights); nf4-fp8 "
                                 "(experimental): stored as NF4, the frozen GEMMs in FP8; embeddings, norms and "
                                 "lm_head stay as loaded"})
    offload_checkpoints: bool = field(default=False, metadata={"help": "keep each checkpointed layer's input in "
                                      "pinned host memory between forward and backward (long context; needs "
                                      "--gradient-checkpointing on)"})
    tile_mlp: int | None = field(default=None, metadata={"help": "run the MLP over tiles of this many tokens, "
                                 "recomputed tile by tile (long context)"})
    cuda_graphs: bool = field(default=False, metadata={"help": "replay each optimizer step (forwards, backwards, "
                              "clipping, AdamW) from CUDA graphs after 3 eager steps (leantune.graphs.CapturedStep): "
                              "the host no longer paces the step; one process, CUDA only (on the CPU the steps run "
                              "eagerly, with a warning)"})
    distributed: str = field(default="auto", metadata={"help": "auto|ddp|fsdp: the engine when launched by torchrun "
                             "(WORLD_SIZE set; --batch-size is per process); auto: FSDP2 when the frozen weights "
                             "take more than half of one device, else DDP"})
    # run management: what --resume reads back, checkpoints kept, the divergence guard, metric reporters
    keep_checkpoints: int = field(default=2, metadata={"help": "checkpoints kept in --output/checkpoints, the "
                                  "newest N (an earlier one to go back to if the newest is damaged)"})
    divergence: str = field(default="stop", metadata={"help": "stop|warn: what a run does when it diverges (a "
                            "NaN or inf loss or gradient norm, an exploding loss, a zero gradient norm for several "
                            "steps in a row)"})
    divergence_factor: float = field(default=4.0, metadata={"help": "a train loss above this many times the "
                                     "initial eval loss counts as divergence (0: off)"})
    zero_grad_steps: int = field(default=3, metadata={"help": "logged steps in a row with a zero gradient norm "
                                 "that count as divergence (0: off; measured only with gradient clipping on)"})
    report_to: str = field(default="none", metadata={"help": "tensorboard, wandb, mlflow (a comma list) or none: "
                           "where the metrics go besides metrics.jsonl (offline, into --output, unless WANDB_MODE "
                           "or MLFLOW_TRACKING_URI say otherwise)"})
    # data sources, columns, chat template, held-out data and dtype (issue #28)
    text_column: str | None = field(default=None, metadata={"help": "column (or JSON key) holding plain text "
                                    "(loss on every token)", "metavar": "COLUMN"})
    messages_column: str | None = field(default=None, metadata={"help": "column holding a conversation: "
                                        "[{role, content}] or ShareGPT [{from, value}] (loss on assistant turns)",
                                        "metavar": "COLUMN"})
    prompt_column: str | None = field(default=None, metadata={"help": "column holding the prompt of a "
                                      "prompt/completion pair (loss on the completion)", "metavar": "COLUMN"})
    completion_column: str | None = field(default=None, metadata={"help": "column holding the completion of a "
                                          "prompt/completion pair", "metavar": "COLUMN"})
    chat_template: str | None = field(default=None, metadata={"help": "file with a Jinja chat template, for a "
                                      "tokenizer without one (or to replace its own); saved with the run's "
                                      "tokenizer", "metavar": "FILE"})
    eval_data: str | None = field(default=None, metadata={"help": "a separate data file for the held-out eval "
                                  "(same formats and columns as --data)", "metavar": "FILE"})
    eval_split: float | None = field(default=None, metadata={"help": "hold out this fraction of the examples for "
                                     "eval (0 < FRACTION < 1)", "metavar": "FRACTION"})
    dtype: str = field(default="auto", metadata={"help": "auto|bf16|fp16|fp32: the model's dtype (auto: bf16 on "
                       "CUDA, fp32 on CPU; LoRA adapters stay fp32)", "metavar": "auto|bf16|fp16|fp32"})

    def validate(self) -> None:
        """Raise LeantuneError for values no run can use (types are checked by ``make_config``)."""
        for name in FLOAT_FIELDS:
            if getattr(self, name) is not None and not math.isfinite(getattr(self, name)):
                raise LeantuneError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        positive = ("batch_size", "grad_accum", "lora_r", "eval_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise LeantuneError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        # seq_len None: resolved once the device is known (``default_seq_len``); position 0 of a sequence is never
        # a target, so 2 tokens is the least that trains
        if self.seq_len is not None and self.seq_len < 2:
            raise LeantuneError(f"--seq-len must be >= 2 (one token to read and one to predict), got {self.seq_len}")
        if self.seq_len is not None and self.seq_len > MAX_SEQ_LEN:
            raise LeantuneError(f"--seq-len must be <= {MAX_SEQ_LEN}, got {self.seq_len}")
        if not 0 <= self.seed < 2**63:  # torch's generators take a signed 64-bit seed
            raise LeantuneError(f"--seed must be in [0, 2^63), got {self.seed}")
        if self.max_steps is not None and self.max_steps < 1:
            raise LeantuneError(f"--max-steps must be >= 1, got {self.max_steps}")
        if self.max_examples is not None and self.max_examples < 1:
            raise LeantuneError(f"--max-examples must be >= 1, got {self.max_examples}")
        if self.epochs <= 0:
            raise LeantuneError(f"--epochs must be > 0, got {self.epochs}")
        if not self.lr > 0:
            raise LeantuneError(f"--lr must be > 0, got {self.lr}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise LeantuneError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.lora_alpha > 0:
            raise LeantuneError(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise LeantuneError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise LeantuneError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0:
            raise LeantuneError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm < 0:
            raise LeantuneError(f"--max-grad-norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise LeantuneError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("gradient_checkpointing", "patch"):
            if getattr(self, name) not in ("on", "off"):
                raise LeantuneError(f"--{name.replace('_', '-')} must be on or off, got {getattr(self, name)!r}")
        if self.resume and self.overwrite:
            raise LeantuneError("--resume and --overwrite exclude each other")
        if self.device not in (None, "cpu", "cuda"):
            raise LeantuneError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.quantize not in (None, "nf4", "fp8", "nf4-fp8"):
            raise LeantuneError(f"--quantize must be nf4, fp8, nf4-fp8 or off (fp4 is not supported yet), got "
                                f"{self.quantize!r}")
        if self.offload_checkpoints and self.gradient_checkpointing != "on":
            raise LeantuneError("--offload-checkpoints keeps the inputs that gradient checkpointing saves: it needs "
                                "--gradient-checkpointing on")
        if self.tile_mlp is not None and self.tile_mlp < 1:
            raise LeantuneError(f"--tile-mlp must be >= 1 (tokens per tile), got {self.tile_mlp}")
        if (self.offload_checkpoints or self.tile_mlp is not None) and self.patch != "on":
            raise LeantuneError("--offload-checkpoints and --tile-mlp are part of leantune.patch: they need --patch on")
        if self.distributed not in ("auto", "ddp", "fsdp"):
            raise LeantuneError(f"--distributed must be auto, ddp or fsdp, got {self.distributed!r}")
        if self.keep_checkpoints < 1:
            raise LeantuneError(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.divergence not in ("stop", "warn"):
            raise LeantuneError(f"--divergence must be stop or warn, got {self.divergence!r}")
        if self.divergence_factor != 0 and not self.divergence_factor > 1:
            raise LeantuneError(f"--divergence-factor must be > 1 (0: off), got {self.divergence_factor}")
        if self.zero_grad_steps < 0:
            raise LeantuneError(f"--zero-grad-steps must be >= 0 (0: off), got {self.zero_grad_steps}")
        from .reporting import parse_report_to

        parse_report_to(self.report_to)
        self._validate_data()

    def _validate_data(self) -> None:
        """The data options' ranges and combinations (issue #28)."""
        if self.eval_data is not None and self.eval_split is not None:
            raise LeantuneError("--eval-data and --eval-split exclude each other (one says where the eval examples "
                                "come from)")
        if self.eval_split is not None and not 0.0 < self.eval_split < 1.0:
            raise LeantuneError(f"--eval-split must be a fraction in (0, 1), got {self.eval_split}")
        kinds = [flag for flag, given in (("--text-column", self.text_column is not None),
                                          ("--messages-column", self.messages_column is not None),
                                          ("--prompt-column/--completion-column",
                                           self.prompt_column is not None or self.completion_column is not None))
                 if given]
        if len(kinds) > 1:
            raise LeantuneError(f"{' and '.join(kinds)} exclude each other: give the column(s) of one kind of data")
        for name in ("text_column", "messages_column", "prompt_column", "completion_column", "chat_template",
                     "eval_data", "data"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise LeantuneError(f"--{name.replace('_', '-')} must not be empty")
        if self.dtype not in ("auto", "bf16", "fp16", "fp32"):
            raise LeantuneError(f"--dtype must be auto, bf16, fp16 or fp32, got {self.dtype!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def field_type(name: str) -> tuple[type, bool]:
    """``(bool | int | float | str, optional)`` of a TrainConfig field, from its annotation."""
    hint = FIELDS[name].type
    if isinstance(hint, str):  # ``from __future__ import annotations``
        hint = eval(hint, {}, {})
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        optional = type(None) in args
        hint = next(a for a in args if a is not type(None))
    return hint, optional


FLOAT_FIELDS = tuple(name for name in FIELDS if field_type(name)[0] is float)
ON_OFF_FIELDS = ("gradient_checkpointing", "patch")
_KIND_WORDS = {bool: "a boolean (true or false)", int: "an integer", float: "a number", str: "a string"}


def coerce(name: str, value, label: str):
    """Check ``value`` against field ``name``'s type; returns it normalised, or raises LeantuneError.

    Strict: an int field takes only an int (not a bool or float), a float field an int or float, a bool field only
    a real boolean (so TOML ``overwrite = "no"`` is an error, not a truthy string). Conveniences natural in TOML:
    ``target_modules`` may be a list of names, ``gradient_checkpointing``/``patch`` may be true/false, ``quantize``
    may be ``"off"`` (None).
    ``label`` names the source in the message (``--lr`` or ``config key 'lr' in run.toml``).
    """
    if name not in FIELDS:
        raise LeantuneError(f"unknown option {name!r}")
    kind, optional = field_type(name)
    if value is None and optional:
        return None
    if name == "target_modules" and isinstance(value, list):
        if not value or not all(isinstance(v, str) and v.strip() for v in value):
            raise LeantuneError(f"{label} must be a string or a non-empty list of module names, got {value!r}")
        return ",".join(v.strip() for v in value)
    if name == "data" and isinstance(value, (list, dict)):  # TOML: a list of sources or a {path = weight} table
        from .sources import spec_from_toml

        value = spec_from_toml(value)
    if name in ON_OFF_FIELDS and isinstance(value, bool):
        return "on" if value else "off"
    if name == "quantize" and value == "off":  # what --help shows as its default: a config's setting undone
        return None
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, kind)
    if not ok:
        expected = _KIND_WORDS[kind]
        if name in ON_OFF_FIELDS:
            expected = "on, off, true or false"
        elif name == "target_modules":
            expected = "a string or a list of module names"
        raise LeantuneError(f"{label} must be {expected}, got {value!r}")
    return value

# What --help shows for defaults that are None (resolved at run time).
NONE_DEFAULTS = {"model": "the embedded SmolLM2-135M-Instruct", "data": "the embedded chitchat dataset",
                 "max_steps": "from --epochs", "seq_len": "1024 on CUDA, 256 on CPU",
                 "warmup_steps": "5%% of the steps, at least 1",
                 "max_examples": "all", "device": "cuda when available",
                 "tile_mlp": "off", "quantize": "off",
                 "text_column": "text", "messages_column": "messages or conversations",
                 "prompt_column": "prompt", "completion_column": "completion", "chat_template": "the tokenizer's",
                 "eval_data": "held out from --data", "eval_split": "up to --eval-size rows from the last tenth"}


def default_seq_len(config: TrainConfig, device: str) -> tuple[TrainConfig, str | None]:
    """``config`` with ``seq_len`` set for ``device`` when none was given (``DEFAULT_SEQ_LEN``), and the line that
    says so (None when it was given)."""
    if config.seq_len is not None:
        return config, None
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    chosen = DEFAULT_SEQ_LEN[kind]
    other = "cpu" if kind == "cuda" else "cuda"
    return dataclasses.replace(config, seq_len=chosen), (
        f"leantune: --seq-len {chosen} (the default on {kind.upper()}; {DEFAULT_SEQ_LEN[other]} on "
        f"{other.upper()}): give --seq-len to choose another")


def load_toml(path: str | Path) -> dict:
    """Read a TOML run file into ``{field: value}``; unknown keys and unreadable files raise LeantuneError."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise LeantuneError(f"config file not found: {path}") from None
    except OSError as exc:
        raise LeantuneError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise LeantuneError(f"malformed TOML in {path}: {exc}") from None
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise LeantuneError(f"unknown key {key!r} in {path}")
        if name in values:  # seq_len and seq-len: TOML sees two keys, the run one option
            raise LeantuneError(f"config key {key!r} in {path} repeats an option already set there "
                                f"({name.replace('_', '-')})")
        values[name] = coerce(name, value, f"config key {key!r} in {path}")
    return values


def make_config(file_values: dict | None = None, flag_values: dict | None = None,
                base: TrainConfig | None = None) -> TrainConfig:
    """Merge defaults (or ``base``), TOML values and flags (``None`` in ``flag_values`` means: not given)."""
    merged = dataclasses.asdict(base or TrainConfig())
    for name, value in (file_values or {}).items():
        merged[name] = coerce(name, value, f"config key {name!r}")
    for name, value in (flag_values or {}).items():
        if value is not None:
            merged[name] = coerce(name, value, f"--{name.replace('_', '-')}")
    for name, value in merged.items():  # the base too: every field has its declared type before validate()
        merged[name] = coerce(name, value, f"--{name.replace('_', '-')}")
    config = TrainConfig(**merged)
    config.validate()
    return config
