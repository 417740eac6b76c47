"""A checkpoint's state.json reads nothing outside its checkpoint (names that escape it, a state edited
without its hash, a file map that is not one), and a checkpoint file that is a link is refused."""
import json
import shutil
from pathlib import Path

import pytest
from helpers import assert_one_error, cli, sample_args

from elflow.runs.checkpoint import list_checkpoints, write_state


def _edit_state(ckpt: Path, change, rehash: bool = True) -> None:
    state = json.loads((ckpt / "state.json").read_text())
    change(state)
    if rehash:  # as someone who knows the format would: state.sha256 matches the edited file
        write_state(ckpt, state)
    else:
        (ckpt / "state.json").write_text(json.dumps(state, indent=2) + "\n")


SECURITY_CASES = [
    ("files-name-escapes-to-a-device", lambda s: s["files"].update({"../../../../../../../../dev/zero": "0" * 64}),
     True, ["not a plain file name", "../../../../../../../../dev/zero", "nothing outside it is read"]),
    ("files-name-escapes-to-a-file", lambda s: s["files"].update({"../../secret.txt": "0" * 64}), True,
     ["not a plain file name", "../../secret.txt"]),
    ("files-name-is-absolute", lambda s: s["files"].update({"/etc/passwd": "0" * 64}), True,
     ["not a plain file name", "/etc/passwd"]),
    ("state-edited-without-its-hash", lambda s: s.update(step=7), False, ["corrupted or edited", "state.sha256"]),
    ("files-is-not-a-map", lambda s: s.update(files=["model.safetensors"]), True,
     ["\"files\" must map file names"]),
]


@pytest.mark.parametrize("change,rehash,needles", [c[1:] for c in SECURITY_CASES], ids=[c[0] for c in SECURITY_CASES])
def test_state_json_reads_nothing_outside_its_checkpoint(capsys, tmp_path, trained, change, rehash, needles,
                                                          monkeypatch):
    import builtins

    run = tmp_path / "t"
    shutil.copytree(trained, run)
    (tmp_path / "secret.txt").write_text("secret")
    for ck in list_checkpoints(run):
        _edit_state(ck, change, rehash)
    opened = []
    real_open = builtins.open

    def watch(path, *a, **k):
        opened.append(str(path))
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", watch)
    code, _, err = cli(capsys, sample_args(run / "checkpoints" / "step_0000006", tmp_path / "s.jsonl"))
    monkeypatch.setattr(builtins, "open", real_open)
    assert_one_error(code, err, "sample", *needles)
    assert not any("secret" in p or "/dev/zero" in p for p in opened)
    assert not (tmp_path / "s.jsonl").exists()


def test_a_checkpoint_file_that_is_a_link_is_refused(capsys, tmp_path, trained):
    run = tmp_path / "t"
    shutil.copytree(trained, run)
    ck = run / "checkpoints" / "step_0000006"
    (tmp_path / "elsewhere.safetensors").write_bytes((ck / "ema.safetensors").read_bytes())
    (ck / "ema.safetensors").unlink()
    (ck / "ema.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    code, _, err = cli(capsys, sample_args(ck, tmp_path / "s.jsonl"))
    assert_one_error(code, err, "sample", "ema.safetensors", "a symbolic link", "refused")
