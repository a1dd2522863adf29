"""Data sources (issue #28): every format gives the rows JSONL gives, column mapping, ShareGPT, chat templates,
held-out data, mixing by weight, and short runs tokenising only what they need. Small files made here, the tiny
byte-level tokenizer of test_train; no model is run."""

from __future__ import annotations

import json
import math
import random
import re
import shutil

import pytest
import torch
from test_train import write_tiny_model

from leantune.errors import LeantuneError
from leantune.train import data as data_mod
from leantune.train import sources
from leantune.train.config import load_toml, make_config
from leantune.train.model import load_tokenizer, resolve_dtype, use_chat_template

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "big", "red"]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """``datasets`` writes its Arrow cache into the test's folder, not the user's."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer("config", write_tiny_model(tmp_path_factory.mktemp("tok") / "model"))


def sentence(rng):
    return " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))


def chats(n, rng):
    return [{"messages": [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]}
            for _ in range(n)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def load(path, tokenizer, **kwargs):
    kwargs.setdefault("seed", random.randrange(1000))
    return data_mod.load_dataset(path, tokenizer, 48, kwargs.pop("eval_size", 3), **kwargs)


def same_rows(a, b):
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_every_format_gives_the_rows_of_jsonl(tmp_path, tokenizer):
    """.json, .parquet, .csv, .arrow, a saved Dataset and a saved DatasetDict: the same packed rows as .jsonl, for
    text, prompt/completion and messages records (a CSV messages cell is JSON text)."""
    import datasets

    rng = random.Random(random.randrange(2**31))
    kinds = {"text": [{"text": sentence(rng)} for _ in range(30)],
             "prompt": [{"prompt": sentence(rng), "completion": sentence(rng)} for _ in range(30)],
             "messages": chats(30, rng)}
    for kind, records in kinds.items():
        seed = rng.randrange(1000)
        ref_train, ref_eval, ref_info = load(write_jsonl(tmp_path / f"{kind}.jsonl", records), tokenizer, seed=seed)
        (tmp_path / f"{kind}.json").write_text(json.dumps(records))
        table = datasets.Dataset.from_list(records)
        table.to_parquet(str(tmp_path / f"{kind}.parquet"))
        cells = [{k: json.dumps(v) if k == "messages" else v for k, v in r.items()} for r in records]
        datasets.Dataset.from_list(cells).to_csv(str(tmp_path / f"{kind}.csv"), index=False)
        table.save_to_disk(str(tmp_path / f"{kind}-saved"))
        datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(tmp_path / f"{kind}-dict"))
        shard = next((tmp_path / f"{kind}-saved").glob("*.arrow"))
        shutil.copy(shard, tmp_path / f"{kind}.arrow")
        for name in (f"{kind}.json", f"{kind}.parquet", f"{kind}.csv", f"{kind}.arrow", f"{kind}-saved",
                     f"{kind}-dict"):
            train, held, info = load(tmp_path / name, tokenizer, seed=seed)
            same_rows(train, ref_train)
            same_rows(held, ref_eval)
            assert info["examples"] == ref_info["examples"] == 30, name


def test_columns_are_mapped_and_a_missing_one_lists_those_found(tmp_path, tokenizer):
    import datasets

    rng = random.Random(random.randrange(2**31))
    pairs = [(sentence(rng), sentence(rng)) for _ in range(25)]
    seed = rng.randrange(1000)
    ref = load(write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "completion": c} for p, c in pairs]), tokenizer,
               seed=seed)
    renamed = datasets.Dataset.from_list([{"question": p, "answer": c, "id": i} for i, (p, c) in enumerate(pairs)])
    renamed.to_parquet(str(tmp_path / "qa.parquet"))
    columns = sources.Columns(prompt="question", completion="answer")
    for path in (tmp_path / "qa.parquet",
                 write_jsonl(tmp_path / "qa.jsonl", [{"question": p, "answer": c} for p, c in pairs])):
        got = load(path, tokenizer, seed=seed, columns=columns)
        same_rows(got[0], ref[0])
        same_rows(got[1], ref[1])
    ref_text = load(write_jsonl(tmp_path / "t.jsonl", [{"text": p} for p, _ in pairs]), tokenizer, seed=seed)
    got = load(tmp_path / "qa.parquet", tokenizer, seed=seed, columns=sources.Columns(text="question"))
    same_rows(got[0], ref_text[0])
    with pytest.raises(LeantuneError, match=r"qa\.parquet: no column 'body' \(--text-column\); columns found: "
                                            "question, answer, id"):
        load(tmp_path / "qa.parquet", tokenizer, columns=sources.Columns(text="body"))
    with pytest.raises(LeantuneError, match=r"qa\.parquet: expected a column 'text', 'messages', 'conversations'.*"
                                            "columns found: question, answer, id"):
        load(tmp_path / "qa.parquet", tokenizer)
    with pytest.raises(LeantuneError, match="--text-column and --messages-column exclude each other"):
        make_config(flag_values={"text_column": "a", "messages_column": "b"})


def test_sharegpt_becomes_messages(tmp_path, tokenizer):
    """``conversations`` of ``{from, value}`` (human/gpt/system) train exactly as the same ``messages``."""
    import datasets

    rng = random.Random(random.randrange(2**31))
    chats_ = chats(24, rng)
    for chat in chats_[::3]:
        chat["messages"].insert(0, {"role": "system", "content": sentence(rng)})
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    share = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in c["messages"]]}
             for c in chats_]
    seed = rng.randrange(1000)
    ref = load(write_jsonl(tmp_path / "m.jsonl", chats_), tokenizer, seed=seed)
    datasets.Dataset.from_list(share).to_parquet(str(tmp_path / "share.parquet"))
    for path in (write_jsonl(tmp_path / "share.jsonl", share), tmp_path / "share.parquet"):
        got = load(path, tokenizer, seed=seed)
        same_rows(got[0], ref[0])
        same_rows(got[1], ref[1])
    assert data_mod.read_records(tmp_path / "share.jsonl")[0] == chats_[0]
    bad = write_jsonl(tmp_path / "bad.jsonl", share[:2] + [{"conversations": [{"from": "bot", "value": "x"}]}])
    with pytest.raises(LeantuneError, match=r"bad\.jsonl:3: ShareGPT turn from 'bot'; expected one of human, "):
        data_mod.read_records(bad)


def test_chat_template_file_for_a_tokenizer_without_one(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    folder = tmp_path / "plain"
    tokenizer.save_pretrained(folder)
    plain = AutoTokenizer.from_pretrained(folder)
    plain.chat_template = None
    messages = [{"role": "user", "content": "hi cat"}, {"role": "assistant", "content": "red dog"}]
    with pytest.raises(LeantuneError, match="has none \\(give one with --chat-template FILE\\)"):
        data_mod.tokenize_messages(plain, messages)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}<|im_end|>{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    use_chat_template(plain, str(template))
    doc = data_mod.tokenize_messages(plain, messages)
    assert plain.decode(doc.input_ids) == "[user]hi cat<|im_end|>[assistant]red dog<|im_end|>"
    assert plain.decode([t for t, keep in zip(doc.input_ids, doc.target) if keep]) == "red dog<|im_end|>"
    plain.save_pretrained(tmp_path / "saved")  # the run's tokenizer carries it
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == template.read_text()
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(LeantuneError, match=r"--chat-template .*bad\.jinja: not a usable Jinja chat template"):
        use_chat_template(plain, str(tmp_path / "bad.jinja"))
    with pytest.raises(LeantuneError, match=r"--chat-template .*none\.jinja: file not found"):
        use_chat_template(plain, str(tmp_path / "none.jinja"))


def test_eval_data_and_eval_split(tmp_path, tokenizer, capsys):
    rng = random.Random(random.randrange(2**31))
    train_file = write_jsonl(tmp_path / "train.jsonl", [{"text": f"{i} " + sentence(rng)} for i in range(40)])
    eval_file = write_jsonl(tmp_path / "eval.jsonl", [{"text": "held " + sentence(rng)} for _ in range(12)])
    train, held, info = load(train_file, tokenizer, eval_data=str(eval_file), eval_size=100)
    numbers = lambda rows: {int(n) for n in re.findall(r"\b(\d+)\b", tokenizer.decode(rows.input_ids.flatten()))}
    # every training example trains (targets: each token after a document's first, the eos included)
    assert info["examples"] == 40 and numbers(train) == set(range(40)) and train.num_targets() == sum(
        len(tokenizer(r["text"], add_special_tokens=False)["input_ids"]) for r in data_mod.read_records(train_file))
    scored = tokenizer.decode(held.input_ids.flatten().tolist())
    assert "also a training source" not in capsys.readouterr().err
    load(train_file, tokenizer, eval_data=str(train_file), eval_size=2)  # the training file as eval: said
    err = capsys.readouterr().err
    assert f"--eval-data {train_file} is also a training source" in err
    assert scored.count("held") == 12 and not numbers(held) and info["eval_rows"] == len(held) < 100
    # --eval-split: the last round(f * N) examples of the order are held out, disjoint from the training rows
    f = rng.choice([0.1, 0.25, 0.4])
    train, held, info = load(train_file, tokenizer, eval_split=f, eval_size=100)
    assert len(numbers(held)) == round(f * 40) and numbers(train) == set(range(40)) - numbers(held)
    assert info["split_unscored"] == 0
    # an eval of one row scores only the held-out examples that fill it: the rest are counted (and said)
    train, held, info = load(train_file, tokenizer, eval_split=f, eval_size=1)
    assert len(held) == 1 and info["split_unscored"] == round(f * 40) - len(numbers(held)) > 0
    assert len(numbers(train)) == 40 - round(f * 40)  # the unscored ones are not trained on either
    with pytest.raises(LeantuneError, match="--eval-data and --eval-split exclude each other"):
        make_config(flag_values={"eval_data": str(eval_file), "eval_split": 0.1})
    with pytest.raises(LeantuneError, match=r"--eval-split must be a fraction in \(0, 1\), got 1.0"):
        make_config(flag_values={"eval_split": 1.0})


def test_mixing_by_weight(tmp_path, tokenizer):
    """Each example comes from source i with probability w_i / sum(w) until one runs out: shares within 5 sigma
    of the weights, no example twice, each source in its own order; without weights every example of each."""
    rng = random.Random(random.randrange(2**31))
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(300)])
    b = tmp_path / "b.parquet"
    import datasets

    datasets.Dataset.from_list([{"text": f"b{i}"} for i in range(300)]).to_parquet(str(b))
    wa = rng.choice([0.6, 0.7, 0.8])
    opened = sources.open_sources(f"{a}:{wa},{b}:{1 - wa:.2f}", sources.Columns(), tokenizer, 48)
    order = sources.mixed_order(opened, seed=rng.randrange(1000))
    assert len(set(order)) == len(order) and max(sum(s == k for s, _ in order) for k in (0, 1)) == 300
    share = sum(s == 0 for s, _ in order) / len(order)
    assert abs(share - wa) <= 5 * math.sqrt(wa * (1 - wa) / len(order)), (share, wa)
    both = sources.mixed_order(sources.open_sources(f"{a},{b}", sources.Columns(), tokenizer, 48), seed=1)
    assert sorted(both) == [(s, i) for s in (0, 1) for i in range(300)]
    _, _, info = load(f"{a}:3,{b}:1", tokenizer)
    assert set(info["sources"]) == {str(a), str(b)} and info["sources"][str(a)] > info["sources"][str(b)]
    with pytest.raises(LeantuneError, match="give a weight to every source"):
        sources.parse_spec(f"{a}:0.5,{b}")
    with pytest.raises(LeantuneError, match="must be > 0"):
        sources.parse_spec(f"{a}:0,{b}:1")
    with pytest.raises(LeantuneError, match=r"the weight of .*a.jsonl must be > 0, got -1.0"):
        sources.parse_spec(f"{a}:-1,{b}:2")  # a negative weight is a weight, not part of the path
    with pytest.raises(LeantuneError, match=r"the weight of .*a.jsonl must be a number > 0, got 'nan'"):
        sources.parse_spec(f"{a}:nan,{b}:1")  # not "give a weight to every source": one was given, not a number
    spelled = tmp_path / "sub" / ".." / "a.jsonl"
    (tmp_path / "sub").mkdir()
    for twice in (f"{a},{a}", f"{a},{spelled}", f"{a}:1,{b}:1,{spelled}:2"):  # held-out rows through the copy
        with pytest.raises(LeantuneError, match=r"a.jsonl is listed more than once .* list each source once"):
            sources.parse_spec(twice)
    odd = tmp_path / "x,y:0.5.jsonl"  # an existing path is one source whatever it holds
    assert sources.parse_spec(str(odd)) == [(odd, None)] or not odd.exists()
    toml = tmp_path / "run.toml"
    toml.write_text(f'data = {{ "{a}" = 0.7, "{b}" = 0.3 }}\n')
    assert make_config(load_toml(toml)).data == f"{a}:0.7,{b}:0.3"
    toml.write_text(f'data = ["{a}:2", "{b}:1"]\n')
    assert make_config(load_toml(toml)).data == f"{a}:2,{b}:1"


def test_a_short_run_tokenises_only_what_it_needs(tmp_path, tokenizer, capsys):
    rng = random.Random(random.randrange(2**31))
    path = write_jsonl(tmp_path / "d.jsonl", chats(400, rng))
    steps, batch = rng.randint(1, 3), 2
    config = make_config(flag_values={"data": str(path), "max_steps": steps, "batch_size": batch, "seq_len": 48})
    train, held, info = data_mod.load_run_data(config, tokenizer, rows_per_step=batch)
    err = capsys.readouterr().err
    assert len(train) == steps * batch and len(held) == batch  # a quarter of steps x batch, at least one batch
    assert info["examples"] < 400 and f"tokenised {info['examples']} of 400 examples" in err
    assert f"--eval-size 32 -> {batch} rows for this {steps}-step run" in err
    config = make_config(flag_values={"data": str(path), "seq_len": 48, "eval_size": 100000})
    _, held, info = data_mod.load_run_data(config, tokenizer, rows_per_step=4)
    err = capsys.readouterr().err
    assert info["examples"] == 400 and f"--eval-size 100000 clamped to {len(held)} rows" in err
    assert len(err.strip().splitlines()) == 1


def test_a_short_run_tokenises_its_rows_and_eval_rows_and_no_more(tmp_path, tokenizer, monkeypatch):
    """Counted: the examples a --max-steps run tokenises are those its rows hold plus at most one look-ahead per
    split (the example that no longer fits), and its rows are the first rows of the run over every example."""
    rng = random.Random(random.randrange(2**31))
    path = write_jsonl(tmp_path / "d.jsonl", chats(400, rng))
    steps, batch, seed = rng.randint(1, 3), rng.randint(1, 3), rng.randrange(1000)
    calls = []
    tokenize = data_mod.tokenize_record
    monkeypatch.setattr(data_mod, "tokenize_record", lambda tok, record: calls.append(1) or tokenize(tok, record))
    values = {"data": str(path), "batch_size": batch, "seq_len": 48, "seed": seed}
    short, held, info = data_mod.load_run_data(make_config(flag_values={**values, "max_steps": steps}), tokenizer,
                                               rows_per_step=batch)
    assert len(short) == steps * batch and len(held) == batch
    assert info["examples"] <= len(calls) <= info["examples"] + 2 and len(calls) < 400 // 4
    calls.clear()
    full, _, _ = data_mod.load_run_data(make_config(flag_values=values), tokenizer, rows_per_step=batch)
    assert 400 <= len(calls) <= 401 and len(full) > len(short)  # every example (the eval split one look-ahead)
    same_rows(short, full.select(slice(0, len(short))))


def test_dtype_option():
    assert resolve_dtype("auto", "cpu") == torch.float32 and resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("fp16", "cpu") == torch.float16 and resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype("fp32", "cuda:0") == torch.float32
    with pytest.raises(LeantuneError, match="--dtype must be auto, bf16, fp16 or fp32, got 'fp8'"):
        make_config(flag_values={"dtype": "fp8"})
