"""del-convert with damaged input and occupied outputs: one line naming the file, exit
status 2, no traceback; an output directory's other files are never touched, a failed
conversion leaves the previous output as it was, and a new one leaves nothing stale."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from del_megatron.cli.convert import main as convert
from del_megatron.models.weight_files import write_files_list

from .tiny_hf import tiny_hf_model


def snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def run(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = convert([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def one_line(err: str, expected: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert expected in err, err


@pytest.fixture
def weights(tmp_path, capsys):
    tiny_hf_model("llama-mha", tmp_path / "hf")
    code, err = run(
        capsys,
        "hf-to-megatron",
        "--hf",
        tmp_path / "hf",
        "--out",
        tmp_path / "m",
        "--tp",
        "4",
        "--divisible-by",
        "8",
    )
    assert code == 0, err
    return tmp_path


def test_a_new_conversion_leaves_nothing_stale(weights, capsys):
    assert sorted(p.name for p in (weights / "m" / "model").glob("tp*")) == [
        f"tp0{r}.safetensors" for r in range(4)
    ]
    code, err = run(
        capsys,
        "hf-to-megatron",
        "--hf",
        weights / "hf",
        "--out",
        weights / "m",
        "--tp",
        "2",
        "--divisible-by",
        "8",
    )
    assert code == 0, err
    assert sorted(p.name for p in (weights / "m" / "model").glob("tp*")) == [
        "tp00.safetensors",
        "tp01.safetensors",
    ]


def test_an_export_directory_with_other_files_is_refused_then_kept(weights, capsys):
    out = weights / "export"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    code, err = run(capsys, "megatron-to-hf", "--checkpoint", weights / "m", "--out", out)
    assert code == 2
    one_line(err, f"{out}: holds files this command did not write (README.md)")
    assert snapshot(out) == {"README.md": hashlib.sha256(b"my notes").hexdigest()}
    code, err = run(
        capsys, "megatron-to-hf", "--checkpoint", weights / "m", "--out", out, "--force"
    )
    assert code == 0, err
    assert (out / "README.md").read_text() == "my notes" and (out / "config.json").is_file()
    before = snapshot(out)  # a second export sets the first aside, the user's file stays
    capsys.readouterr()
    code = convert(
        ["megatron-to-hf", "--checkpoint", str(weights / "m"), "--out", str(out), "--force"]
    )
    assert code == 0, capsys.readouterr().err
    [aside] = out.glob("previous-*")
    assert f"{out}: the previous output moved to {aside}\n" in capsys.readouterr().out
    now = snapshot(out)
    assert {k: v for k, v in now.items() if not k.startswith("previous-")} == before
    earlier = {k.split("/", 1)[1]: v for k, v in now.items() if k.startswith("previous-")}
    assert earlier == {k: v for k, v in before.items() if k != "README.md"}


def test_a_failed_export_leaves_the_previous_one(weights, capsys):
    out = weights / "export"
    assert run(capsys, "megatron-to-hf", "--checkpoint", weights / "m", "--out", out)[0] == 0
    before = snapshot(out)
    shard = weights / "m" / "model" / "tp03.safetensors"
    shard.write_bytes(shard.read_bytes()[:200])
    write_files_list(shard.parent)  # listed as it is: the export starts, then meets it
    code, err = run(capsys, "megatron-to-hf", "--checkpoint", weights / "m", "--out", out)
    assert code == 2
    one_line(err, "tp03.safetensors: not a readable safetensors file")
    assert snapshot(out) == before
    assert not list(weights.glob(".export.*"))  # no staging, no lock


def break_weights(case: str, root: Path) -> None:
    model = root / "m" / "model"
    if case in ("gap in the shards", "a listed shard missing"):
        (model / "tp01.safetensors").unlink()
    elif case == "arch.json garbage":
        (model / "arch.json").write_text("[1, 2")
    if case in ("gap in the shards", "arch.json garbage"):  # listed as they are now: the
        write_files_list(model)  # check that reads them sees them
    elif case == "model dir holds a user file":
        (model / "notes.txt").write_text("mine")
    elif case == "hf config not JSON":
        (root / "hf" / "config.json").write_text("{nope")
    elif case == "hf index broken":
        (root / "hf" / "model.safetensors.index.json").write_text('{"weight_map": 3}')
    elif case == "hf weights cut":
        path = root / "hf" / "model.safetensors"
        path.write_bytes(path.read_bytes()[:300])
    elif case == "out is a file":
        (root / "afile").write_text("x")


CASES = [
    (
        "gap in the shards",
        ["megatron-to-hf", "--checkpoint", "{m}", "--out", "{tmp}/x"],
        "are not tp00 to tp02",
    ),
    (
        "a listed shard missing",
        ["megatron-to-hf", "--checkpoint", "{m}", "--out", "{tmp}/x"],
        "model/tp01.safetensors: missing (listed in",
    ),
    (
        "arch.json garbage",
        ["megatron-to-hf", "--checkpoint", "{m}", "--out", "{tmp}/x"],
        "arch.json: not an architecture record",
    ),
    (
        "model dir holds a user file",
        ["hf-to-megatron", "--hf", "{hf}", "--out", "{m}", "--divisible-by", "8"],
        "holds files this command did not write (notes.txt)",
    ),
    (
        "hf config not JSON",
        ["hf-to-megatron", "--hf", "{hf}", "--out", "{tmp}/y"],
        "config.json: not JSON",
    ),
    (
        "hf index broken",
        ["hf-to-megatron", "--hf", "{hf}", "--out", "{tmp}/y"],
        "not a safetensors index",
    ),
    (
        "hf weights cut",
        ["hf-to-megatron", "--hf", "{hf}", "--out", "{tmp}/y"],
        "model.safetensors: not a readable safetensors file",
    ),
    (
        "out is a file",
        ["megatron-to-hf", "--checkpoint", "{m}", "--out", "{tmp}/afile"],
        "afile: exists and is not a directory",
    ),
    (
        "no checkpoint",
        ["megatron-to-hf", "--checkpoint", "{tmp}/nope", "--out", "{tmp}/x"],
        "nope: does not exist",  # was "model/arch.json: no such file"
    ),
    (
        "no hf checkpoint",
        ["hf-to-megatron", "--hf", "{tmp}/nope", "--out", "{tmp}/y"],
        "nope: does not exist",
    ),
    (
        "tp zero",
        ["hf-to-megatron", "--hf", "{hf}", "--out", "{tmp}/y", "--tp", "0"],
        "--tp: must be at least 1",
    ),
    (
        "unknown dtype",
        ["megatron-to-hf", "--checkpoint", "{m}", "--out", "{tmp}/x", "--dtype", "float8"],
        "invalid choice: 'float8'",
    ),
]


@pytest.mark.parametrize(("case", "argv", "expected"), CASES, ids=[c[0] for c in CASES])
def test_convert_mistakes(case, argv, expected, weights, capsys):
    break_weights(case, weights)
    before = snapshot(weights)
    names = {"tmp": weights, "m": weights / "m", "hf": weights / "hf"}
    code, err = run(capsys, *(a.format(**names) for a in argv))
    assert code == 2
    if expected.startswith(("--", "invalid")):  # argparse's usage error
        assert expected in err and "Traceback" not in err
    else:
        one_line(err, expected)
    assert snapshot(weights) == before  # nothing written, nothing lost


def test_a_full_disk_is_one_line_and_the_previous_output_stays(weights, capsys, tmpfs):
    """ENOSPC while writing (a 64 KiB tmpfs): one line naming the output, nothing left
    (before: safetensors' own error as a traceback)."""
    small = tmpfs("64k")
    for argv in (
        ["hf-to-megatron", "--hf", weights / "hf", "--out", small / "m", "--tp", "4"],
        ["megatron-to-hf", "--checkpoint", weights / "m", "--out", small / "export"],
    ):
        code, err = run(capsys, *argv)
        assert code == 2
        one_line(err, f"{argv[4]}: no space left on the device")
        assert not [p for p in small.rglob("*") if p.is_file()]  # no staging, lock, half output
