"""Data: read a file, tokenise each example with a loss mask, pack into fixed-length rows.

Formats (auto-detected):
- ``.jsonl``: one JSON object per line, with ``text`` (loss on every token), ``messages`` (``[{role, content}]``,
  rendered with the tokenizer's chat template, loss on assistant turns only) or ``prompt``/``completion`` (loss on
  the completion only). Blank lines are skipped.
- ``.json``: the chitchat-dataset format (``{id: {"messages": [[{text, sender}, ...], ...]}}``: each inner list is
  one turn, alternating senders map to user/assistant), or a JSON list of records as in JSONL.
- ``.txt``: one token stream, cut into ``seq_len`` windows, loss on every token.
- Any other extension is refused (``.ndjson`` and no extension read as JSONL).

Labels follow transformers' causal-LM convention: ``labels`` is aligned with ``input_ids`` and the model shifts it
(position j predicts ``labels[j+1]``). A token is a target when its label is its own id; everything else is -100.
Packing concatenates whole documents into rows of ``seq_len`` tokens; ``position_ids`` restart at 0 for each
document (transformers 5 derives a block-diagonal causal mask from them when no ``attention_mask`` is passed, see
``masking_utils.find_packed_sequence_indices``), and each document's first token gets label -100, so after the shift
the last position of every document has no target (it would otherwise predict the next document's first token).
Padding at the end of a row forms its own segment with label -100.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LeantuneError
from .metrics import say

IGNORE_INDEX = -100
DATA_SUFFIXES = (".jsonl", ".ndjson", "", ".json", ".txt")


@dataclass
class Document:
    """One tokenised example: ``input_ids`` and a same-length ``target`` mask (True: the loss includes it)."""

    input_ids: list[int]
    target: list[bool]


@dataclass
class PackedData:
    """Packed rows: ``input_ids``, ``labels``, ``position_ids``, each int64 ``[rows, seq_len]``."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index) -> PackedData:
        return PackedData(self.input_ids[index], self.labels[index], self.position_ids[index])

    def num_targets(self) -> int:
        """Tokens the loss counts (after transformers' shift, position 0's label is never used)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


def chitchat_path() -> Path:
    """Path of the embedded chitchat ``dataset.json`` (located through ``leantune.assets``, never imported)."""
    from .. import assets

    try:
        return assets.chitchat_path()
    except FileNotFoundError as exc:
        raise LeantuneError(f"the embedded dataset is missing: {exc}") from None


# ---------------------------------------------------------------------------------------------------------------
# Reading records


def _parse_json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LeantuneError(f"malformed JSON at {where}: {exc.msg} (column {exc.colno})") from None


def _chitchat_records(raw: dict, path: Path) -> list[dict]:
    """Map chitchat conversations to ``messages`` records; the first sender of a non-empty turn is the user (a
    conversation opened by an empty turn would otherwise start with an assistant turn, which chat templates cannot
    render a prompt for)."""
    records = []
    for key, conversation in raw.items():
        turns = conversation.get("messages") if isinstance(conversation, dict) else None
        if not isinstance(turns, list):
            raise LeantuneError(f"{path}: not the chitchat format (a conversation without a 'messages' list)")
        roles: dict[str, str] = {}
        messages = []
        for turn in turns:
            if not turn:
                continue
            if not isinstance(turn, list) or not all(isinstance(item, dict) for item in turn):
                raise LeantuneError(f"{path}: conversation {key!r}: a turn must be a list of {{sender, text}} "
                                    f"objects, got {json.dumps(turn)[:60]}")
            sender = turn[0].get("sender")
            text = "\n".join(str(item.get("text", "")) for item in turn).strip()
            _check_text(text, f"{path}: conversation {key!r}")
            if not text:  # an empty turn names no speaker: the user is the first one with words
                continue
            if sender not in roles:
                if len(roles) == 2:
                    break  # a third speaker: keep the two-party part
                roles[sender] = "user" if not roles else "assistant"
            if messages and messages[-1]["role"] == roles[sender]:
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": roles[sender], "content": text})
        records.append({"messages": messages})
    return records


def read_records(path: str | Path) -> list[dict]:
    """Read a data file into a list of records (dicts with ``text``, ``messages`` or ``prompt``/``completion``).

    Raises LeantuneError naming the file for a missing or unreadable file, and ``file:line`` for a malformed line.
    """
    path = Path(path)
    if not path.exists():
        raise LeantuneError(f"data file not found: {path}")
    if path.is_dir():
        raise LeantuneError(f"data file is a directory: {path}")
    suffix = path.suffix.lower()
    if suffix not in DATA_SUFFIXES:  # e.g. a .csv would otherwise fail as "malformed JSON" on its first line
        raise LeantuneError(f"data file {path}: unsupported extension {path.suffix!r}; expected .jsonl (or .ndjson or "
                            "no extension), .json or .txt")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark some editors write is not data
    except OSError as exc:
        raise LeantuneError(f"cannot read data file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise LeantuneError(f"cannot read data file {path}: not UTF-8 text") from None
    if suffix == ".txt":
        return [{"stream": text}]
    if suffix == ".json":
        raw = _parse_json(text, str(path))
        if isinstance(raw, dict):
            return _chitchat_records(raw, path)
        if isinstance(raw, list):
            return [_check_record(r, f"{path}:item {i}") for i, r in enumerate(raw)]
        raise LeantuneError(f"{path}: expected a JSON object (chitchat format) or a list of records")
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            records.append(_check_record(_parse_json(line, f"{path}:{number}"), f"{path}:{number}"))
    return records


ROLES = ("system", "user", "assistant", "tool")


def _check_text(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON's "\ud800" escapes decode to unpaired UTF-16 surrogates
        raise LeantuneError(f"{where}: the text holds {exc.object[exc.start:exc.end]!a}, an unpaired UTF-16 "
                            "surrogate (not a character)") from None


def _check_record(record, where: str) -> dict:
    if not isinstance(record, dict):
        raise LeantuneError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise LeantuneError(f"{where}: 'messages' must be a list of {{role, content}} strings")
        unknown = sorted({m["role"] for m in messages} - set(ROLES))
        if unknown:
            raise LeantuneError(f"{where}: unknown role(s) {', '.join(map(repr, unknown))}; expected one of "
                                f"{', '.join(ROLES)}")
        if messages and messages[0]["role"] == "assistant":
            raise LeantuneError(f"{where}: the conversation starts with an assistant turn; it needs a user or system "
                                "turn before it (the chat template renders what the assistant answers)")
        for m in messages:
            _check_text(m["content"], where)
    elif "prompt" in record or "completion" in record:
        if not isinstance(record.get("prompt"), str) or not isinstance(record.get("completion"), str):
            raise LeantuneError(f"{where}: 'prompt' and 'completion' must both be strings")
        _check_text(record["prompt"] + record["completion"], where)
    elif "text" in record:
        if not isinstance(record["text"], str):
            raise LeantuneError(f"{where}: 'text' must be a string")
        _check_text(record["text"], where)
    else:
        raise LeantuneError(f"{where}: a record needs 'text', 'messages', or 'prompt' and 'completion'")
    return record


# ---------------------------------------------------------------------------------------------------------------
# Tokenising


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_messages(tokenizer, messages: list[dict]) -> Document:
    """Render a conversation with the chat template; targets are the characters each assistant turn adds.

    The span of assistant turn i is ``render(messages[:i+1])`` minus ``render(messages[:i], generation prompt)``
    (its content and end-of-turn marker); tokens whose first character lies in a span are targets.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise LeantuneError("'messages' data needs a tokenizer with a chat template; this model's tokenizer has none")
    if not any(m["role"] == "assistant" for m in messages):
        return Document([], [])  # nothing to learn (dropped by build_documents); templates reject empty lists
    full = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1])
        if not (full.startswith(upto) and upto.startswith(prefix)):
            raise LeantuneError("the chat template does not render conversations prefix by prefix; "
                                "cannot locate assistant turns")
        spans.append((len(prefix), len(upto)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    target = [any(lo <= start < hi for lo, hi in spans) for start, _ in encoded["offset_mapping"]]
    return Document(list(encoded["input_ids"]), target)


def tokenize_record(tokenizer, record: dict) -> Document:
    """Tokenise one record (see the module docstring for which tokens are targets)."""
    if "messages" in record:
        return tokenize_messages(tokenizer, record["messages"])
    if "prompt" in record:
        prompt = _encode(tokenizer, record["prompt"])
        completion = _encode(tokenizer, record["completion"]) + _eos(tokenizer)
        return Document(prompt + completion, [False] * len(prompt) + [True] * len(completion))
    ids = _encode(tokenizer, record["text"]) + _eos(tokenizer)
    return Document(ids, [True] * len(ids))


def build_documents(records: list[dict], tokenizer, seq_len: int) -> tuple[list[Document], int]:
    """Tokenise records into documents of at most ``seq_len`` tokens.

    Returns ``(documents, truncated)``: a longer example is cut to ``seq_len`` and counted. Documents without any
    target token (e.g. a conversation with no assistant turn, or cut before its first one) are dropped. A ``.txt``
    stream is cut into consecutive ``seq_len`` windows (not counted as truncation).
    """
    documents, truncated = [], 0
    for record in records:
        if "stream" in record:
            ids = _encode(tokenizer, record["stream"]) + _eos(tokenizer)
            for start in range(0, len(ids), seq_len):
                chunk = ids[start:start + seq_len]
                if len(chunk) > 1:
                    documents.append(Document(chunk, [True] * len(chunk)))
            continue
        document = tokenize_record(tokenizer, record)
        if len(document.input_ids) > seq_len:
            truncated += 1
            document = Document(document.input_ids[:seq_len], document.target[:seq_len])
        # position 0 of a document never has a target (nothing in the document predicts it)
        if any(document.target[1:]):
            documents.append(document)
    return documents, truncated


# ---------------------------------------------------------------------------------------------------------------
# Packing


def pack(documents: list[Document], seq_len: int, pad_id: int) -> PackedData:
    """Pack whole documents, in order, into rows of ``seq_len`` tokens (a document that does not fit starts a row).

    Each document's position ids run 0..n-1; its first label is -100; labels of non-target tokens are -100; the
    tail padding is a separate segment (positions 0..p-1, labels -100).
    """
    rows_ids, rows_labels, rows_pos = [], [], []
    ids, labels, pos = [], [], []

    def close_row():
        pad = seq_len - len(ids)
        rows_ids.append(ids + [pad_id] * pad)
        rows_labels.append(labels + [IGNORE_INDEX] * pad)
        rows_pos.append(pos + list(range(pad)))

    for document in documents:
        n = len(document.input_ids)
        if n > seq_len:
            raise ValueError(f"document of {n} tokens exceeds seq_len={seq_len}")
        if len(ids) + n > seq_len:
            close_row()
            ids, labels, pos = [], [], []
        ids += document.input_ids
        labels += [IGNORE_INDEX] + [t if keep else IGNORE_INDEX
                                    for t, keep in zip(document.input_ids[1:], document.target[1:])]
        pos += list(range(n))
    if ids:
        close_row()
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.long).reshape(-1, seq_len)
    return PackedData(as_tensor(rows_ids), as_tensor(rows_labels), as_tensor(rows_pos))


def _warn_if_only_end_markers(records: list[dict], path) -> None:
    """One warning line when every answer of the data (assistant turns, completions) is empty: the run would then
    learn nothing but the end-of-turn or end-of-text markers."""
    answers = [m["content"] for r in records for m in r.get("messages", []) if m["role"] == "assistant"]
    answers += [r["completion"] for r in records if "completion" in r and "messages" not in r]
    if answers and not any(a.strip() for a in answers):
        what = "assistant turn" if any("messages" in r for r in records) else "completion"
        say(f"leantune: warning: every {what} of {path} is empty ({len(answers)} of them): the run learns only "
            "the end-of-turn markers")


def load_dataset(path: str | Path, tokenizer, seq_len: int, eval_size: int, seed: int,
                 max_examples: int | None = None) -> tuple[PackedData, PackedData, dict]:
    """Read, tokenise, shuffle (seeded), pack; the last ``eval_size`` rows are the held-out split.

    The eval split shrinks to a tenth of the rows when the data is small (at least one row). Returns
    ``(train, eval, info)`` with ``info`` = examples, documents, truncated, train_rows, eval_rows, target_tokens.
    Raises LeantuneError when nothing is left to train on.
    """
    records = read_records(path)
    rng = random.Random(seed)
    rng.shuffle(records)
    if max_examples is not None:
        records = records[:max_examples]
    _warn_if_only_end_markers(records, path)
    documents, truncated = build_documents(records, tokenizer, seq_len)
    if not documents and truncated:  # the targets were there, cut off by the sequence length
        raise LeantuneError(f"--seq-len {seq_len} is too short: no example of {path} keeps a token to train on "
                            f"within its first {seq_len} tokens ({truncated} of {len(records)} examples were "
                            "truncated); use a larger --seq-len")
    if not documents:
        raise LeantuneError(f"empty dataset after filtering: no example of {path} has a token to train on")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    packed = pack(documents, seq_len, pad_id)
    if len(packed) < 2:
        raise LeantuneError(f"dataset too small: {path} packs into {len(packed)} sequence of {seq_len} tokens; "
                            "need at least 2 (train and eval)")
    n_eval = min(eval_size, max(1, len(packed) // 10))
    train, held_out = packed.select(slice(0, len(packed) - n_eval)), packed.select(slice(len(packed) - n_eval, None))
    info = {"examples": len(records), "documents": len(documents), "truncated": truncated,
            "train_rows": len(train), "eval_rows": len(held_out), "target_tokens": train.num_targets()}
    return train, held_out, info
