"""Data sources of ``leantune train``: which files ``--data`` names, how each is read, how its columns become
records, and the order in which several are mixed.

``--data`` is one source or a comma-separated list; a source is ``PATH`` or ``PATH:WEIGHT``:

- ``chat.jsonl``: one file. ``a.jsonl,b.parquet``: both, every example of each, shuffled together.
- ``a.jsonl:0.7,b.parquet:0.3``: a weighted mix. Each example of the mix comes from source i with probability
  ``w_i / sum(w)`` (a seeded draw per example, each source in its own seeded order) until one source runs out, as
  ``datasets.interleave_datasets(probabilities=..., stopping_strategy="first_exhausted")`` does: no example is
  repeated and the shares follow the weights. Weights are given to every source or to none, and a file is listed
  once (twice, its held-out examples would be trained on through the other copy).
- A path that exists is always one source, even if it holds a comma or a colon. In TOML: the same string, or a list
  of those strings, or a table ``{ "a.jsonl" = 0.7, "b.parquet" = 0.3 }``.

Formats, by extension: ``.jsonl`` / ``.ndjson`` / none, ``.json`` and ``.txt`` are read by ``data.read_records``
(errors name the line; a JSONL file may mix record kinds); ``.parquet``, ``.csv`` and ``.arrow`` through
``datasets.load_dataset`` (memory-mapped Arrow in the ``datasets`` cache, rows converted only when used), and a
folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` through ``datasets.load_from_disk`` (of
a DatasetDict, the ``train`` split).

Columns (``Columns``): ``--text-column``, ``--messages-column`` or ``--prompt-column`` / ``--completion-column``
name the column to use; without them a row's kind is found from the names ``messages``, ``conversations``,
``prompt`` + ``completion``, ``text``. A messages column whose turns are ``{from, value}`` is ShareGPT: ``human``,
``gpt``, ``system`` (and ``user``, ``assistant``, ``tool``) become the roles user, assistant, system (user,
assistant, tool). In CSV a messages cell holds the list as JSON text.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import LeantuneError
from .records import SHAREGPT_ROLES, _check_record, _encode, _eos, read_records, to_messages  # noqa: F401

DATASETS_SUFFIXES = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}

_WEIGHT = re.compile(r"(.+):([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)")  # a sign too, so -1 is refused as a weight


@dataclass(frozen=True)
class Columns:
    """Which column holds what (None: found from the default names)."""

    text: str | None = None
    messages: str | None = None
    prompt: str | None = None
    completion: str | None = None

    @classmethod
    def of(cls, config) -> Columns:
        return cls(config.text_column, config.messages_column, config.prompt_column, config.completion_column)

    def given(self) -> bool:
        return any((self.text, self.messages, self.prompt, self.completion))


def parse_spec(spec: str) -> list[tuple[Path, float | None]]:
    """``--data``'s sources as ``[(path, weight or None)]``; raises LeantuneError for a malformed list."""
    if Path(spec).exists() or not spec.strip():
        return [(Path(spec), None)]
    sources = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise LeantuneError(f"--data {spec!r}: an empty entry in the comma-separated list")
        match = _WEIGHT.fullmatch(part)
        if match and not Path(part).exists():
            weight = float(match.group(2))
            if not (math.isfinite(weight) and weight > 0):
                raise LeantuneError(f"--data {spec!r}: the weight of {match.group(1)} must be > 0, got {weight}")
            sources.append((Path(match.group(1)), weight))
        else:
            head, colon, tail = part.rpartition(":")
            if colon and not Path(part).exists() and Path(head).exists():  # PATH:WEIGHT with a weight not a number
                raise LeantuneError(f"--data {spec!r}: the weight of {head} must be a number > 0, got {tail!r}")
            sources.append((Path(part), None))
    resolved = [p.resolve() for p, _ in sources]
    twice = sorted({str(p) for p in resolved if resolved.count(p) > 1})
    if twice:  # its rows would be both in the training split and in the held-out one
        raise LeantuneError(f"--data {spec!r}: {', '.join(twice)} is listed more than once (held-out examples "
                            "would be trained on through the other copy); list each source once")
    weighted = [w is not None for _, w in sources]
    if len(sources) > 1 and any(weighted) and not all(weighted):
        raise LeantuneError(f"--data {spec!r}: give a weight to every source (PATH:WEIGHT) or to none")
    return sources


def spec_from_toml(value):
    """A TOML ``data`` value as the ``--data`` string: a list of sources or a ``{path = weight}`` table."""
    if isinstance(value, dict):
        return ",".join(f"{path}:{weight}" for path, weight in value.items())
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    return value


def canonical(spec: str) -> Path:
    """The path ``run.json`` records for ``--data``: the file itself for one source, else the list with absolute
    paths (so a resumed run is checked against the same files however they were spelled)."""
    sources = parse_spec(spec)
    if len(sources) == 1:
        return sources[0][0]
    return Path(",".join(f"{p.resolve()}" + (f":{w:g}" if w is not None else "") for p, w in sources))


# ---------------------------------------------------------------------------------------------------------------
# One source


class Source:
    """One data file or saved dataset: ``len(source)`` examples, ``source.record(i)`` the i-th as a checked record
    (``{"text"}``, ``{"messages"}``, ``{"prompt", "completion"}`` or a pre-tokenised ``{"tokens"}`` window)."""

    def __init__(self, path: Path, columns: Columns, tokenizer, seq_len: int, weight: float | None = None):
        self.path, self.columns, self.weight = path, columns, weight
        self._dataset = None
        if not path.exists():
            raise LeantuneError(f"data file not found: {path}")
        suffix = path.suffix.lower()
        if path.is_dir():
            self._dataset = _load_saved(path)
        elif suffix in DATASETS_SUFFIXES:
            self._dataset = _load_file(path, DATASETS_SUFFIXES[suffix])
        if self._dataset is not None:
            self.column_names = list(self._dataset.column_names)
            self._kind = _kind_of(self.column_names, columns, path)
            return
        mapped = (lambda r, where: _checked(_mapped(r, columns, where), where)) if columns.given() else None
        records = read_records(path, mapped)
        if records and "stream" in records[0]:  # .txt: windows of seq_len tokens are its examples
            ids = _encode(tokenizer, records[0]["stream"]) + _eos(tokenizer)
            self._records = [{"tokens": ids[i:i + seq_len]} for i in range(0, len(ids), seq_len)
                             if len(ids[i:i + seq_len]) > 1]
        else:
            self._records = records

    def __len__(self) -> int:
        return len(self._dataset) if self._dataset is not None else len(self._records)

    def record(self, i: int) -> dict:
        if self._dataset is None:
            return self._records[i]
        where = f"{self.path}: row {i}"
        return _checked(_from_row(self._dataset[i], self._kind, where), where)


def _load_file(path: Path, builder: str):
    import datasets

    datasets.disable_progress_bars()  # one run prints its own lines
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # pyarrow and datasets raise many kinds; none is worth a traceback
        from .metrics import one_line

        why = "it holds no rows" if "corresponds to no data" in str(exc) else one_line(exc)[:300]
        raise LeantuneError(f"cannot read data file {path} as {builder.upper()}: {why}") from None


def _load_saved(path: Path):
    import datasets

    if not any((path / name).is_file() for name in ("dataset_dict.json", "state.json", "dataset_info.json")):
        raise LeantuneError(f"data file is a directory: {path}, and not a saved dataset (no dataset_dict.json or "
                            "state.json; expected a folder written by Dataset.save_to_disk)")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        from .metrics import one_line

        raise LeantuneError(f"cannot read the saved dataset {path}: {one_line(exc)[:300]}") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" not in loaded and len(splits) != 1:
            raise LeantuneError(f"the saved dataset {path} has no 'train' split (splits: {', '.join(splits)}); "
                                "save the one to train on as its own Dataset")
        loaded = loaded["train" if "train" in loaded else splits[0]]
    return loaded


def _kind_of(names: list[str], columns: Columns, path: Path) -> tuple[str, ...]:
    """``(kind, column...)`` of a table's rows: ("text", c), ("messages", c) or ("prompt", p, c)."""
    found = f"columns found: {', '.join(names) or '(none)'}"
    for flag, name in (("--text-column", columns.text), ("--messages-column", columns.messages),
                       ("--prompt-column", columns.prompt), ("--completion-column", columns.completion)):
        if name is not None and name not in names:
            raise LeantuneError(f"data file {path}: no column {name!r} ({flag}); {found}")
    if columns.messages:
        return ("messages", columns.messages)
    if columns.prompt or columns.completion:
        prompt, completion = columns.prompt or "prompt", columns.completion or "completion"
        for name, flag in ((prompt, "--prompt-column"), (completion, "--completion-column")):
            if name not in names:
                raise LeantuneError(f"data file {path}: no column {name!r} (the {flag} of a prompt/completion "
                                    f"pair); {found}")
        return ("prompt", prompt, completion)
    if columns.text:
        return ("text", columns.text)
    for name in ("messages", "conversations"):
        if name in names:
            return ("messages", name)
    if "prompt" in names and "completion" in names:
        return ("prompt", "prompt", "completion")
    if "text" in names:
        return ("text", "text")
    raise LeantuneError(f"data file {path}: expected a column 'text', 'messages', 'conversations' or 'prompt' and "
                        f"'completion'; {found}; name the one to use with --text-column, --messages-column or "
                        "--prompt-column/--completion-column")


def _mapped(record, columns: Columns, where: str) -> dict:
    """A JSON record under ``--*-column``: the named fields under the names ``data._check_record`` reads."""
    if not isinstance(record, dict):
        raise LeantuneError(f"{where}: expected a JSON object, got {type(record).__name__}")
    kind = _kind_of(list(record), columns, Path(where))
    return _from_row(record, kind, where)


def _from_row(row: dict, kind: tuple[str, ...], where: str) -> dict:
    if kind[0] == "text":
        return {"text": row[kind[1]]}
    if kind[0] == "prompt":
        return {"prompt": row[kind[1]], "completion": row[kind[2]]}
    return {"messages": to_messages(row[kind[1]], where)}


def _checked(record: dict, where: str) -> dict:
    return _check_record(record, where)


# ---------------------------------------------------------------------------------------------------------------
# Several sources


def open_sources(spec: str, columns: Columns, tokenizer, seq_len: int) -> list[Source]:
    """Every source of ``--data`` (see the module docstring), each read and its columns checked."""
    return [Source(path, columns, tokenizer, seq_len, weight) for path, weight in parse_spec(spec)]


def mixed_order(sources: list[Source], seed: int) -> list[tuple[int, int]]:
    """The examples of the run as ``(source index, row)`` in a seeded order (see the module docstring)."""
    if len(sources) == 1 or sources[0].weight is None:
        order = [(s, i) for s, source in enumerate(sources) for i in range(len(source))]
        random.Random(seed).shuffle(order)  # one source: the permutation of its rows alone, as before mixing
        return order
    rows = []
    for s, source in enumerate(sources):
        perm = list(range(len(source)))
        random.Random(seed + 1 + s).shuffle(perm)
        rows.append(perm)
    draw, weights, taken, order = random.Random(seed), [s.weight for s in sources], [0] * len(sources), []
    while True:
        s = draw.choices(range(len(sources)), weights)[0]
        if taken[s] == len(rows[s]):
            return order
        order.append((s, rows[s][taken[s]]))
        taken[s] += 1
