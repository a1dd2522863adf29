"""Reading JSON/JSONL/TXT records and checking them: what ``data`` (tokenising, packing) and ``sources`` (the
``--data`` list, other formats) both need, so that neither imports the other. Formats: ``data``'s docstring."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import LeantuneError

DATA_SUFFIXES = (".jsonl", ".ndjson", "", ".json", ".txt")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}


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
            got = f"a {type(conversation).__name__}" if not isinstance(conversation, dict) else "an object"
            raise LeantuneError(f"{path}: a JSON object must be the chitchat format ({{id: {{'messages': [...]}}}}), "
                                f"but {key!r} holds {got} without a 'messages' list; a .json file may also hold a "
                                "list of records, or one record per line (JSON Lines)")
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


def read_records(path: str | Path, check=None) -> list[dict]:
    """Read a data file into a list of records (dicts with ``text``, ``messages`` or ``prompt``/``completion``).

    Raises LeantuneError naming the file for a missing or unreadable file, and ``file:line`` for a malformed line.
    ``check(record, where)`` returns each JSON record checked (default ``_check_record``; ``sources`` maps the
    ``--*-column`` fields first).
    """
    checked = check or _check_record
    path = Path(path)
    if not path.exists():
        raise LeantuneError(f"data file not found: {path}")
    if path.is_dir():
        raise LeantuneError(f"data file is a directory: {path}")
    suffix = path.suffix.lower()
    if suffix not in DATA_SUFFIXES:  # e.g. a .csv would otherwise fail as "malformed JSON" on its first line
        raise LeantuneError(f"data file {path}: unsupported extension {path.suffix!r}; expected .jsonl (or .ndjson or "
                            "no extension), .json, .txt, .parquet, .csv, .arrow or a saved dataset folder")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark some editors write is not data
    except OSError as exc:
        raise LeantuneError(f"cannot read data file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise LeantuneError(f"cannot read data file {path}: not UTF-8 text") from None
    if suffix == ".txt":
        return [{"stream": text}]
    raw = _json_value(text, path) if suffix == ".json" else None
    if raw is not None:
        if isinstance(raw, dict):
            return _chitchat_records(raw, path)
        if isinstance(raw, list):
            return [checked(r, f"{path}:item {i}") for i, r in enumerate(raw)]
        raise LeantuneError(f"{path}: expected a JSON object (chitchat format) or a list of records")
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            records.append(checked(_parse_json(line, f"{path}:{number}"), f"{path}:{number}"))
    return records


def _json_value(text: str, path: Path):
    """A .json file's one JSON value, or None when it is JSON Lines (one object per line, as datasets' ``to_json``
    writes): its text is then read as a .jsonl file's. Raises LeantuneError for malformed JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        first = next((line for line in text.splitlines() if line.strip()), "")
        if exc.msg == "Extra data":
            try:
                if isinstance(json.loads(first), dict):
                    return None
            except json.JSONDecodeError:
                pass
        raise LeantuneError(f"malformed JSON at {path}: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None


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
    if "conversations" in record and "messages" not in record:  # ShareGPT
        record = {"messages": record["conversations"]}
    if "messages" in record:
        record = {**record, "messages": to_messages(record["messages"], where)}
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


def to_messages(value, where: str):
    """A messages cell as ``[{role, content}]``: JSON text (CSV) is parsed, ShareGPT ``{from, value}`` turns are
    given their roles; anything else is returned for ``data._check_record`` to judge."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise LeantuneError(f"{where}: a messages cell must be a list of turns (in CSV: as JSON text), got "
                                f"{value[:60]!r}") from None
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
        return value
    if all("from" in t and "value" in t for t in value):
        messages = []
        for turn in value:
            role = SHAREGPT_ROLES.get(turn["from"])
            if role is None:
                raise LeantuneError(f"{where}: ShareGPT turn from {turn['from']!r}; expected one of "
                                    f"{', '.join(SHAREGPT_ROLES)}")
            messages.append({"role": role, "content": turn["value"]})
        return messages
    # Arrow gives every turn every key of the column (None where a turn has none): keep the ones it has, which a
    # chat template may read (name, tool_calls, ...)
    return [{k: v for k, v in t.items() if v is not None} for t in value]
