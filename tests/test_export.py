"""``leantune export``: the merged model matches the adapter, keeps the base's dtype, never replaces anything but a
previous export, and a failure or stop leaves no partial folder."""

from __future__ import annotations

import json
from pathlib import Path

import cli_support
import pytest
import torch
from cli_support import assert_error, files_of, run_cli, stopped_run, train_args, umask, weights_folder

tiny = cli_support.tiny  # the fixture: a tiny model and chat data


def test_export_errors(tmp_path, capsys):
    code, err = run_cli(capsys, "export", "--adapter", tmp_path, "--out", tmp_path / "merged")
    assert_error(code, err, "no adapter in")


def test_export_target_checks(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    afile = tmp_path / "a-file"
    afile.write_text("keep")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", afile)
    assert_error(code, err, str(afile), "not a directory")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", afile / "sub")
    assert_error(code, err, "not a directory")
    assert afile.read_text() == "keep"
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("precious")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", user)
    assert_error(code, err, "not empty", "--overwrite")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", user, "--overwrite")
    assert_error(code, err, str(user), "not a leantune export")
    assert files_of(user) == {user / "thesis.tex": b"precious"}
    merged = tmp_path / "merged"
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged)
    assert code == 0, err
    assert (merged / "leantune_export.json").is_file() and (merged / "config.json").is_file()
    weights = (merged / "model.safetensors").read_bytes()
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged)
    assert_error(code, err, "not empty")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged, "--overwrite")  # a previous export
    assert code == 0, err
    assert (merged / "model.safetensors").read_bytes() == weights
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize("targets, unchanged", [("q_proj,v_proj,lm_head", "input"), ("embed_tokens,q_proj", "output")])
def test_export_of_a_tied_embedding_adapter_unties_and_matches_the_adapter(tiny, tmp_path, capsys, targets,
                                                                             unchanged):
    """A LoRA on lm_head (or embed_tokens) of a model with tied embeddings is merged into an untied copy: the other
    embedding stays the base's and the merged model's logits match the adapter model's (merged into the shared
    matrix, they differed by up to 17.9, and 58.8 for embed_tokens)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from leantune.train.model import load_model

    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run, "--target-modules", targets, "--lr", "5e-2"), "--max-steps", "3")
    assert code == 0, err
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / "merged")
    assert code == 0, err
    seed = json.loads((run / "run.json").read_text())["config"]["seed"]
    base = load_model("config", tiny["model"], torch.float32, "cpu", seed)
    embeddings = getattr(base, f"get_{unchanged}_embeddings")().weight.detach().clone()
    adapted = PeftModel.from_pretrained(base, run / "adapter").eval()
    adapted_name = "lm_head" if unchanged == "input" else "embed_tokens"
    factors = [p for n, p in adapted.named_parameters() if adapted_name in n and "lora_" in n]
    assert len(factors) == 2 and all(p.abs().max() > 0 for p in factors)  # trained: PEFT starts one factor at 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert torch.equal(getattr(merged, f"get_{unchanged}_embeddings")().weight, embeddings)
    ids = torch.randint(0, embeddings.shape[0], (2, 17))
    with torch.no_grad():
        diff = (adapted(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_export_never_replaces_a_model_folder_or_the_base_and_takes_dot(tiny, tmp_path, capsys, monkeypatch):
    """A folder of save_pretrained files is no previous export: --overwrite refuses to replace a user's model or the
    run's own base; --out "" is an error, not the cwd; --out . (an empty cwd) takes the export."""
    from transformers import AutoModelForCausalLM

    from leantune.train.model import load_model

    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    users_model = tmp_path / "users-model"
    AutoModelForCausalLM.from_config(load_model("config", tiny["model"], torch.float32, "cpu", 0).config) \
        .save_pretrained(users_model)
    before = files_of(users_model)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", users_model, "--overwrite")
    assert_error(code, err, str(users_model), "not a leantune export")
    assert files_of(users_model) == before
    base_folder = tiny["model"].parent
    before = files_of(base_folder)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", base_folder, "--overwrite")
    assert_error(code, err, "base model")
    assert files_of(base_folder) == before
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", "")
    assert_error(code, err, "--out", "empty")
    here = tmp_path / "empty-cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", ".")
    assert code == 0, err
    assert (here / "leantune_export.json").is_file() and not list(tmp_path.glob(".*tmp*"))


def test_export_keeps_a_16_bit_base_in_its_dtype(tiny, tmp_path, capsys):
    """A bf16 base is exported in bf16 (the fp32 merge rounded once), not in fp32 at twice the disk."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM


    base16 = weights_folder(tiny, tmp_path / "base16", torch.bfloat16)
    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run, "--lr", "1e-2", model=base16))
    assert code == 0, err
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / "merged")
    assert code == 0, err
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base16, dtype=torch.float32),
                                        run / "adapter").merge_and_unload()
    for name, param in adapted.named_parameters():  # the fp32 merge, rounded once to bf16
        assert torch.equal(merged.get_parameter(name), param.to(torch.bfloat16)), name


def test_export_dtype_follows_the_stored_weights(tiny, tmp_path, capsys):
    """The export dtype follows the stored weights, not config.json's "dtype": bf16 weights without a declared
    dtype stay bf16, fp32 weights declared bf16 stay fp32."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    undeclared = weights_folder(tiny, tmp_path / "bf16-undeclared", torch.bfloat16)
    config = json.loads((undeclared / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (undeclared / "config.json").write_text(json.dumps(config))
    declared = weights_folder(tiny, tmp_path / "fp32-declared-bf16", dtype="bfloat16")
    for folder, expected in ((undeclared, torch.bfloat16), (declared, torch.float32)):
        run = tmp_path / f"run-{folder.name}"
        code, err = run_cli(capsys, *train_args(tiny, run, model=folder))
        assert code == 0, err
        code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / f"merged-{folder.name}")
        assert code == 0, err
        out = AutoModelForCausalLM.from_pretrained(tmp_path / f"merged-{folder.name}", dtype="auto")
        assert {p.dtype for p in out.parameters()} == {expected}, folder.name
        with safe_open(str(tmp_path / f"merged-{folder.name}" / "model.safetensors"), framework="pt") as fh:
            assert {fh.get_tensor(k).dtype for k in fh.keys()} == {expected}, folder.name


def _run_and_export(tiny, tmp_path, capsys):
    run, merged = tmp_path / "run", tmp_path / "merged"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged)
    assert code == 0, err
    return run, merged


def test_sigterm_between_the_renames_of_an_export_keeps_the_previous_one(tiny, tmp_path, capsys, monkeypatch):
    """SIGTERM between setting the previous export aside and moving the new one in puts the previous one back and
    leaves no hidden folder (not a full-size .tmp, not the previous export in .old-*); exit 143."""
    import os
    import signal

    run, merged = _run_and_export(tiny, tmp_path, capsys)
    previous = files_of(merged)
    real_replace = os.replace

    def terminated_between_renames(src, dst):
        real_replace(src, dst)
        if ".old-" in str(dst):
            os.kill(os.getpid(), signal.SIGTERM)

    def outside(signum, frame):
        raise RuntimeError("SIGTERM was not handled by leantune")

    monkeypatch.setattr(os, "replace", terminated_between_renames)
    previous_handler = signal.signal(signal.SIGTERM, outside)
    try:
        code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged, "--overwrite")
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        monkeypatch.setattr(os, "replace", real_replace)
    assert code == 143, err
    assert files_of(merged) == previous and sorted(p.name for p in tmp_path.iterdir()) == ["merged", "run"]


def test_a_full_disk_during_export_is_one_error_line_and_keeps_the_previous_export(tiny, tmp_path, capsys,
                                                                                   monkeypatch):
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    run, merged = _run_and_export(tiny, tmp_path, capsys)
    previous = files_of(merged)

    def disk_full(self, *args, **kwargs):
        raise SafetensorError("No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", disk_full)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged, "--overwrite")
    assert_error(code, err, "cannot write the export", "No space left")
    monkeypatch.undo()
    assert files_of(merged) == previous and sorted(p.name for p in tmp_path.iterdir()) == ["merged", "run"]


def test_export_into_the_empty_working_directory_keeps_that_folder(tiny, tmp_path, capsys, monkeypatch):
    """--out . writes into the shell's cwd (same inode), never replaces it."""
    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    here = tmp_path / "cwd"
    here.mkdir()
    inode = here.stat().st_ino
    monkeypatch.chdir(here)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", ".")
    assert code == 0, err
    assert here.stat().st_ino == inode and (Path.cwd() / "leantune_export.json").is_file()


def test_export_through_a_symlink_and_beside_stale_temporary_folders(tiny, tmp_path, capsys):
    """--out as a symlink to an export replaces the folder it points to (the link stays); a killed export's
    leftovers beside it (named as pid-based temporary folders were) are not shipped in the new export."""
    import os

    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    real = tmp_path / "exports" / "v1"
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", real)
    assert code == 0, err
    link = tmp_path / "current"
    link.symlink_to(real, target_is_directory=True)
    stale = tmp_path / f".current.tmp-{os.getpid()}"  # what a killed export of the old naming left
    stale.mkdir()
    (stale / "junk.bin").write_bytes(b"x")
    (real / "extra.txt").write_text("from the previous export")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", link, "--overwrite")
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert not (real / "extra.txt").exists() and not (real / "junk.bin").exists()
    assert sorted(p.name for p in real.parent.iterdir()) == ["v1"]


def test_out_through_a_missing_folder_and_dot_dot_is_checked_as_the_folder_it_names(tiny, tmp_path, capsys,
                                                                                    monkeypatch):
    """--out missing/../userdata is userdata: not empty, so refused without --overwrite (Path.absolute keeps "..")."""
    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    user = tmp_path / "userdata"
    user.mkdir()
    (user / "notes.txt").write_text("precious")
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", "nosuch/../userdata")
    assert_error(code, err, "not empty")
    assert files_of(user) == {user / "notes.txt": b"precious"} and not (tmp_path / "nosuch").exists()


def test_a_parent_that_cannot_be_written_is_refused_before_the_model_loads(tiny, tmp_path, capsys, monkeypatch):
    import os

    from leantune.train import merge

    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **k: False if "locked" in str(path) else
                        real_access(path, mode, **k))
    (tmp_path / "locked").mkdir()
    monkeypatch.setattr(merge, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / "locked" / "new")
    assert_error(code, err, "cannot write in", "locked")


def test_a_signal_between_the_moves_into_an_empty_out_leaves_it_empty(tiny, tmp_path, capsys, monkeypatch):
    """Ctrl-C after the first file moved into an empty --out removes what the export moved there; the cleanup
    works with handlers, so an idle thread (as torch keeps) receiving the signal changes nothing."""
    import os
    import signal
    import threading

    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    stop = threading.Event()  # an idle thread, as torch keeps: signals may be delivered to it
    threading.Thread(target=stop.wait, daemon=True).start()
    empty = tmp_path / "empty"
    empty.mkdir()
    real_replace = os.replace

    def signalled_after_the_first_move(src, dst):
        real_replace(src, dst)
        if ".leantune-export-" in str(src):
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "replace", signalled_after_the_first_move)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", empty)
    monkeypatch.setattr(os, "replace", real_replace)
    stop.set()
    assert code == 130 and list(empty.iterdir()) == [], err


def test_export_folders_are_created_with_the_umask_mode(tiny, tmp_path, capsys):
    import stat

    run = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny, run))
    assert code == 0, err
    merged = tmp_path / "merged"
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged)
    assert code == 0, err
    assert stat.S_IMODE(merged.stat().st_mode) & 0o055 == stat.S_IMODE(0o777 & ~umask()) & 0o055


def test_a_signal_while_tidying_up_a_replaced_export_is_noted_not_acted_on(tiny, tmp_path, capsys, monkeypatch):
    """Once the new export is in place, a Ctrl-C during the removal of the previous one neither stops it (no full
    copy of the old model left behind) nor fails the export."""
    import os
    import shutil as shutil_module
    import signal

    run, merged = _run_and_export(tiny, tmp_path, capsys)
    real_rmtree = shutil_module.rmtree

    def signalled_while_tidying(path, *args, **kwargs):
        if ".old-" in str(path):
            os.kill(os.getpid(), signal.SIGINT)  # noted, not acted on: the new export is already in place
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil_module, "rmtree", signalled_while_tidying)
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", merged, "--overwrite")
    monkeypatch.setattr(shutil_module, "rmtree", real_rmtree)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_export_of_a_stopped_run_uses_its_last_checkpoint_and_says_so(tiny, tmp_path, capsys, monkeypatch):
    """A run stopped by Ctrl-C has no adapter/ yet: export merges its last checkpoint, in one line naming the step
    and --resume, and the merged model matches the checkpoint's adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from leantune.train.model import load_model

    run = tmp_path / "run"
    stopped_run(capsys, monkeypatch, train_args(tiny, run, "--max-steps", "4", "--lr", "5e-2"))
    assert not (run / "adapter").exists()
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / "merged")
    assert code == 0, err
    notes = [line for line in err.splitlines() if "last checkpoint" in line]
    assert len(notes) == 1 and "step 2 of 4" in notes[0] and "--resume" in notes[0], err

    # the reference: the checkpoint's tensors in a PEFT model built from a finished run's adapter config
    done = tmp_path / "done"
    code, err = run_cli(capsys, *train_args(tiny, done, "--max-steps", "4", "--lr", "5e-2"))
    assert code == 0, err
    base = load_model("config", tiny["model"], torch.float32, "cpu", 0)
    adapted = PeftModel.from_pretrained(base, done / "adapter")
    from peft import set_peft_model_state_dict

    saved = load_file(str(run / "checkpoints" / "step-000002" / "adapter_model.safetensors"))
    set_peft_model_state_dict(adapted, saved)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(0, 250, (2, 17))
    with torch.no_grad():
        diff = (adapted.eval()(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_export_of_a_run_stopped_before_its_first_checkpoint_says_so(tiny, tmp_path, capsys, monkeypatch):
    from leantune.train import loop

    run = tmp_path / "run"

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "evaluate", stopped)
    code, err = run_cli(capsys, *train_args(tiny, run))
    monkeypatch.undo()
    assert code == 130 and (run / "run.json").is_file(), err
    code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / "merged")
    assert_error(code, err, f"no adapter in {run}", "stopped before its first checkpoint")
    assert not (tmp_path / "merged").exists()


def test_a_damaged_adapter_or_checkpoint_is_one_line_and_an_earlier_checkpoint_exports(tiny, tmp_path, capsys,
                                                                                        monkeypatch):
    """A truncated adapter file, in adapter/ or in the newest checkpoint of a stopped run, or a garbage state.json:
    one line naming the file and the checkpoint to export instead (as --adapter), every file left as it was; that
    checkpoint then exports and matches its tensors."""
    import hashlib

    run = tmp_path / "run"
    stopped_run(capsys, monkeypatch, train_args(tiny, run, "--max-steps", "3", "--save-every", "1"))
    digests = lambda: {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*") if p.is_file()}  # noqa: E731
    newest, earlier = run / "checkpoints" / "step-000002", run / "checkpoints" / "step-000001"
    for name, damage in (("adapter_model.safetensors", lambda raw: raw[:len(raw) // 2]),
                         ("state.json", lambda raw: b"{not json")):
        file = newest / name
        raw = file.read_bytes()
        file.write_bytes(damage(raw))
        before = digests()
        code, err = run_cli(capsys, "export", "--adapter", run, "--out", tmp_path / "merged")
        assert_error(code, err, f"checkpoint file {file} is truncated or corrupt", f"--adapter {earlier}",
                     "nothing was deleted")
        assert digests() == before and not (tmp_path / "merged").exists()
        file.write_bytes(raw)
    code, err = run_cli(capsys, "export", "--adapter", earlier, "--out", tmp_path / "merged")
    assert code == 0, err
    assert json.loads((tmp_path / "merged" / "leantune_export.json").read_text())["adapter"] == str(earlier)

    done = tmp_path / "done"
    code, err = run_cli(capsys, *train_args(tiny, done, "--max-steps", "2", "--save-every", "1"))
    assert code == 0, err
    adapter_file = done / "adapter" / "adapter_model.safetensors"
    raw = adapter_file.read_bytes()
    adapter_file.write_bytes(raw[:len(raw) // 3])
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in done.rglob("*") if p.is_file()}
    code, err = run_cli(capsys, "export", "--adapter", done, "--out", tmp_path / "merged2")
    assert_error(code, err, f"adapter file {adapter_file} is truncated or corrupt",
                 f"--adapter {done / 'checkpoints' / 'step-000002'}")
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in done.rglob("*") if p.is_file()} == before


def test_a_truncated_gguf_model_is_one_line(tiny, tmp_path, capsys):
    """A GGUF file cut short (a download that stopped): one line naming the file, not numpy's reshape error."""
    import hashlib

    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "model.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) - 4096])  # half of the tensor's 8 KiB
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    code, err = run_cli(capsys, *train_args(tiny, tmp_path / "out", model=path))
    assert_error(code, err, f"model file {path} is truncated or corrupt", f"{len(raw) - 4096} bytes",
                 "download or convert it again")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest and not (tmp_path / "out").exists()
