"""Data: read a file, tokenise each example with a loss mask, pack into fixed-length rows.

Formats (auto-detected; ``sources`` reads them, mixes several and maps columns):
- ``.jsonl``: one JSON object per line, with ``text`` (loss on every token), ``messages`` (``[{role, content}]``,
  rendered with the tokenizer's chat template, loss on assistant turns only), ``conversations`` (ShareGPT:
  ``[{from, value}]``, converted to messages) or ``prompt``/``completion`` (loss on the completion only). Blank
  lines are skipped.
- ``.json``: the chitchat-dataset format (``{id: {"messages": [[{text, sender}, ...], ...]}}``: each inner list is
  one turn, alternating senders map to user/assistant), or a JSON list of records as in JSONL.
- ``.txt``: one token stream, cut into ``seq_len`` windows, loss on every token.
- ``.parquet``, ``.csv``, ``.arrow`` and saved ``datasets`` folders: through the ``datasets`` library (``sources``).
- Any other extension is refused (``.ndjson`` and no extension read as JSONL).

Only what the run needs is tokenised (``load_dataset``'s ``train_rows``): a run of a given ``--max-steps`` packs
its ``max_steps x batch`` rows from the front of the shuffled examples and stops there.

Labels follow transformers' causal-LM convention: ``labels`` is aligned with ``input_ids`` and the model shifts it
(position j predicts ``labels[j+1]``). A token is a target when its label is its own id; everything else is -100.
Packing concatenates whole documents into rows of ``seq_len`` tokens; ``position_ids`` restart at 0 for each
document (transformers 5 derives a block-diagonal causal mask from them when no ``attention_mask`` is passed, see
``masking_utils.find_packed_sequence_indices``), and each document's first token gets label -100, so after the shift
the last position of every document has no target (it would otherwise predict the next document's first token).
Padding at the end of a row forms its own segment with label -100.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LeantuneError
from .metrics import say
from .records import DATA_SUFFIXES, ROLES, _check_record, _check_text, _encode, _eos, read_records  # noqa: F401
from .sources import Columns, Source, mixed_order, open_sources

IGNORE_INDEX = -100


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

    def counts(self, index) -> tuple[int, int]:
        """(target tokens, tokens) of the rows ``index``: ``select(index)``'s ``num_targets()`` and token count,
        without copying the rows."""
        index = torch.as_tensor(index, dtype=torch.long)
        return int((self.labels[index, 1:] != IGNORE_INDEX).sum()), index.numel() * self.input_ids.shape[1]


def chitchat_path() -> Path:
    """Path of the embedded chitchat ``dataset.json`` (located through ``leantune.assets``, never imported)."""
    from .. import assets

    try:
        return assets.chitchat_path()
    except FileNotFoundError as exc:
        raise LeantuneError(f"the embedded dataset is missing: {exc}") from None


# ---------------------------------------------------------------------------------------------------------------
# Reading records


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_messages(tokenizer, messages: list[dict]) -> Document:
    """Render a conversation with the chat template; targets are the characters each assistant turn adds.

    The span of assistant turn i is ``render(messages[:i+1])`` minus ``render(messages[:i], generation prompt)``
    (its content and end-of-turn marker); tokens whose first character lies in a span are targets.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise LeantuneError("'messages' data needs a tokenizer with a chat template; this model's tokenizer has none "
                            "(give one with --chat-template FILE)")
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
    if "tokens" in record:  # a window of a .txt stream (sources.Source)
        return Document(list(record["tokens"]), [True] * len(record["tokens"]))
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


class Packer:
    """Packs documents, in the order given, into rows of ``seq_len`` tokens (a document that does not fit starts a
    new row). Each document's position ids run 0..n-1; its first label is -100; labels of non-target tokens are
    -100; the tail padding of a row is a separate segment (positions 0..p-1, labels -100)."""

    def __init__(self, seq_len: int, pad_id: int):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.rows: list[torch.Tensor] = []  # closed rows, each int64 [3, seq_len]: ids, labels, positions
        self._ids, self._labels, self._pos = [], [], []

    def fits(self, document: Document) -> bool:
        """Whether ``document`` goes into the open row (else ``add`` closes it first)."""
        return len(self._ids) + len(document.input_ids) <= self.seq_len

    def add(self, document: Document) -> None:
        n = len(document.input_ids)
        if n > self.seq_len:
            raise ValueError(f"document of {n} tokens exceeds seq_len={self.seq_len}")
        if not self.fits(document):
            self.close()
        self._ids += document.input_ids
        self._labels += [IGNORE_INDEX] + [t if keep else IGNORE_INDEX
                                          for t, keep in zip(document.input_ids[1:], document.target[1:])]
        self._pos += list(range(n))

    def close(self) -> None:
        """Close the open row (if it holds anything), padded to ``seq_len``."""
        if not self._ids:
            return
        pad = self.seq_len - len(self._ids)
        self.rows.append(torch.tensor([self._ids + [self.pad_id] * pad, self._labels + [IGNORE_INDEX] * pad,
                                       self._pos + list(range(pad))], dtype=torch.long))
        self._ids, self._labels, self._pos = [], [], []

    def packed(self) -> PackedData:
        """The closed rows (the open one is closed first)."""
        self.close()
        rows = torch.stack(self.rows) if self.rows else torch.empty((0, 3, self.seq_len), dtype=torch.long)
        return PackedData(rows[:, 0].contiguous(), rows[:, 1].contiguous(), rows[:, 2].contiguous())


def pack(documents: list[Document], seq_len: int, pad_id: int) -> PackedData:
    """Pack whole documents, in order, into rows of ``seq_len`` tokens (see ``Packer``)."""
    packer = Packer(seq_len, pad_id)
    for document in documents:
        packer.add(document)
    return packer.packed()


@dataclass
class _Stream:
    """What ``_pack_stream`` read: examples consumed (``used``: their documents are in the rows or had nothing to
    learn), documents packed, truncated examples, examples per source, and the answers seen (for the warning)."""

    used: int = 0
    documents: int = 0
    truncated: int = 0
    per_source: dict | None = None
    answers: int = 0
    empty_answers: int = 0
    answer_kind: str = "completion"


def _pack_stream(examples, tokenizer, seq_len: int, pad_id: int, max_rows: int | None,
                 enough: int | None = None) -> tuple[PackedData, _Stream]:
    """Tokenise and pack ``examples`` (an iterable of ``(source index, record)``) until ``max_rows`` rows are full
    (None: all of them), or once ``enough`` examples are used and a row holds something. Only the examples whose
    documents went into those rows count as used."""
    packer, stream = Packer(seq_len, pad_id), _Stream(per_source={})
    for source, record in examples:
        document = tokenize_record(tokenizer, record)
        cut = len(document.input_ids) > seq_len
        if cut:
            document = Document(document.input_ids[:seq_len], document.target[:seq_len])
        learns = any(document.target[1:])  # position 0 of a document never has a target
        if learns and max_rows is not None and not packer.fits(document) and len(packer.rows) + 1 >= max_rows:
            packer.close()  # the rows are full: this example stays unread
            break
        stream.used += 1
        stream.truncated += cut
        stream.per_source[source] = stream.per_source.get(source, 0) + 1
        answers = [m["content"] for m in record.get("messages", ()) if m["role"] == "assistant"]
        answers += [record["completion"]] if "completion" in record and "messages" not in record else []
        stream.answers += len(answers)
        stream.empty_answers += sum(not a.strip() for a in answers)
        stream.answer_kind = "assistant turn" if "messages" in record else stream.answer_kind
        if learns:
            packer.add(document)
            stream.documents += 1
        if enough is not None and stream.used >= enough and stream.documents:
            break
    return packer.packed(), stream


def _examples(sources: list[Source], order):
    return ((s, sources[s].record(i)) for s, i in order)


def load_dataset(path: str | Path, tokenizer, seq_len: int, eval_size: int, seed: int,
                 max_examples: int | None = None, *, columns: Columns = Columns(), eval_data: str | None = None,
                 eval_split: float | None = None, train_rows: int | None = None,
                 eval_rows: int | None = None) -> tuple[PackedData, PackedData, dict]:
    """Read ``path`` (``--data``: one source or a mix, see ``sources``), order the examples (seeded), tokenise and
    pack them into a training split and a held-out split.

    Held out: ``eval_data`` (its own examples), else the last ``eval_split`` fraction of the examples, else (the
    default) examples from the end of the order, at most a tenth of them (at least one). Of the held-out examples
    only as many are packed as fill ``eval_rows`` rows (default ``eval_size``); the training split packs the examples
    from the front of the order until ``train_rows`` rows are full (None: every example). Returns ``(train, eval,
    info)``, ``info`` = examples (those tokenised), documents, truncated, train_rows, eval_rows, target_tokens,
    available (examples in the data), sources (examples used per source) and held_out (which examples).
    Raises LeantuneError naming the data when nothing is left to train on or to evaluate.
    """
    sources = open_sources(str(path), columns, tokenizer, seq_len)
    order = mixed_order(sources, seed)
    if max_examples is not None:
        order = order[:max_examples]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    want_eval = eval_size if eval_rows is None else eval_rows
    if eval_data is not None:
        if any(Path(eval_data).resolve() == source.path.resolve() for source in sources):
            say(f"leantune: warning: --eval-data {eval_data} is also a training source: the eval scores examples "
                "the run trains on, so its loss measures memorisation, not held-out loss")
        held_source = [Source(Path(eval_data), columns, tokenizer, seq_len)]
        held, held_stream = _pack_stream(_examples(held_source, mixed_order(held_source, seed)), tokenizer,
                                         seq_len, pad_id, want_eval)
        train_order, held_out = order, f"--eval-data {eval_data}"
    else:
        k = max(1, round(eval_split * len(order))) if eval_split is not None else max(1, len(order) // 10)
        if k >= len(order) and eval_split is not None:
            raise LeantuneError(f"dataset too small: {path} has {len(order)} example(s); holding out {k} for eval "
                                "leaves none to train on")
        # the default takes the examples it needs from the end: a tenth at most, unless none of those has a target
        tail = order[len(order) - k:] if eval_split is not None else order[::-1]
        held, held_stream = _pack_stream(_examples(sources, tail), tokenizer, seq_len, pad_id, want_eval,
                                         enough=k if eval_split is None else None)
        kept = k if eval_split is not None else held_stream.used
        train_order = order[:len(order) - kept]
        held_out = f"--eval-split {eval_split:g} of the examples" if eval_split is not None else (
            "at most a tenth of the examples")
    train, stream = _pack_stream(_examples(sources, train_order), tokenizer, seq_len, pad_id, train_rows)
    truncated = stream.truncated + held_stream.truncated
    if not stream.documents and not held_stream.documents:
        if truncated:  # the targets were there, cut off by the sequence length
            raise LeantuneError(f"--seq-len {seq_len} is too short: no example of {path} keeps a token to train on "
                                f"within its first {seq_len} tokens ({truncated} of {stream.used + held_stream.used} "
                                "examples were truncated); use a larger --seq-len")
        raise LeantuneError(f"empty dataset after filtering: no example of {path} has a token to train on")
    if not len(held) and eval_data is not None:
        raise LeantuneError(f"--eval-data {eval_data}: no example has a token to score")
    if not len(train) or not len(held):
        raise LeantuneError(f"dataset too small: {path} packs into {len(train) + len(held)} sequence(s) of {seq_len} "
                            "tokens; need at least 2 (train and eval)")
    if stream.answers and stream.empty_answers == stream.answers:
        say(f"leantune: warning: every {stream.answer_kind} of {path} is empty ({stream.answers} of them): the run "
            "learns only the end-of-turn markers")
    names = [str(source.path) for source in sources]
    info = {"examples": stream.used + (held_stream.used if eval_data is None else 0), "documents": stream.documents,
            "truncated": stream.truncated + (held_stream.truncated if eval_data is None else 0),
            "train_rows": len(train), "eval_rows": len(held), "target_tokens": train.num_targets(),
            "available": len(order), "sources": {names[s]: n for s, n in sorted(stream.per_source.items())},
            "split_unscored": (k - held_stream.used) if eval_data is None and eval_split is not None else 0,
            "held_out": held_out}
    return train, held, info


def load_run_data(config, tokenizer, rows_per_step: int) -> tuple[PackedData, PackedData, dict]:
    """``load_dataset`` for a run of ``config`` (a TrainConfig) taking ``rows_per_step`` rows per optimizer step
    (batch x accumulation x processes), sized to it. With ``--max-steps``, only the ``max_steps x rows_per_step``
    training rows are tokenised, and the held-out split is at most a quarter of them (at least one ``--batch-size``);
    each cut of an asked size is said in one line.
    """
    data = config.data if config.data is not None else chitchat_path()
    train_rows = eval_rows = None
    if config.max_steps is not None:
        train_rows = config.max_steps * rows_per_step
        eval_rows = min(config.eval_size, max(config.batch_size, -(-train_rows // 4)))
        if eval_rows < config.eval_size:
            say(f"leantune: --eval-size {config.eval_size} -> {eval_rows} rows for this {config.max_steps}-step run "
                f"(eval is at most a quarter of the {train_rows} rows it trains on, at least one --batch-size)")
    train, held, info = load_dataset(data, tokenizer, config.seq_len, config.eval_size, config.seed,
                                     config.max_examples, columns=Columns.of(config), eval_data=config.eval_data,
                                     eval_split=config.eval_split, train_rows=train_rows, eval_rows=eval_rows)
    if info["eval_rows"] < (eval_rows or config.eval_size):
        say(f"leantune: --eval-size {config.eval_size} clamped to {info['eval_rows']} rows: the held-out examples "
            f"({info['held_out']}) pack into {info['eval_rows']} of --seq-len {config.seq_len}")
    if info["split_unscored"]:  # held out by --eval-split, yet beyond the rows the eval packs
        say(f"leantune: --eval-split {config.eval_split:g}: {info['split_unscored']} of its held-out examples are "
            f"neither trained on nor scored (the eval packs --eval-size {info['eval_rows']} rows); raise --eval-size "
            "to score more")
    if train_rows is not None and info["examples"] < info["available"]:
        say(f"leantune: tokenised {info['examples']} of {info['available']} examples: what {config.max_steps} steps x "
            f"{rows_per_step} rows and {info['eval_rows']} eval rows need")
    if len(info["sources"]) > 1:
        total = sum(info["sources"].values())
        say("leantune: data mix: " + ", ".join(f"{name} {n} examples ({100 * n / total:.0f}%)"
                                               for name, n in info["sources"].items()))
    return train, held, info
