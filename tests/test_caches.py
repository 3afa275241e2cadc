"""The terminal (issue 37): caches of the libraries a command starts (torch extensions,
Triton, wandb, Hugging Face, matplotlib) go under one writable directory when HOME cannot
hold them, said once; with no writable directory at all the command refuses in one line
before it starts. Before: a FileNotFoundError traceback from DeepSpeed's extension build
under ~/.cache."""

from __future__ import annotations

from del_megatron import caches
from del_megatron.cli.convert import main as convert


def test_caches_leave_an_unwritable_home_said_once(tmp_path, capsys, monkeypatch):
    home = tmp_path / "a-file" / "home"  # under a file: not writable, whoever runs it
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(caches.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    env = {"HOME": str(home), "LOCAL_RANK": "0", "WANDB_DIR": "x"}
    base = caches.use_writable_caches("del-train", env)
    assert base == tmp_path / "tmp" / f"del-megatron-cache-{caches.os.getuid()}"
    assert env["TORCH_EXTENSIONS_DIR"] == str(base / "torch_extensions_dir")
    assert env["TRITON_CACHE_DIR"].startswith(str(base)) and env["HF_HOME"].startswith(str(base))
    err = capsys.readouterr().err
    assert err == (
        f"del-train: HOME={home} is not writable: caches (torch extensions, Triton, wandb, "
        f"Hugging Face, matplotlib) go under {base}\n"
    )
    assert caches.use_writable_caches("del-train", env) is None  # placed: nothing more said
    assert capsys.readouterr().err == ""
    placed = {"HOME": str(home), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    caches.use_writable_caches("del-train", placed)
    assert placed["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "ext")  # the user's own choice
    writable = {"HOME": str(tmp_path / "home")}
    assert caches.use_writable_caches("del-train", writable) is None and len(writable) == 1


def test_no_writable_place_for_caches_is_one_line_before_anything(tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "a-file" / "home"))
    monkeypatch.setattr(caches.tempfile, "gettempdir", lambda: str(tmp_path / "a-file" / "tmp"))
    for name, *_ in caches.CACHES:
        monkeypatch.delenv(name, raising=False)
    code = convert(["hf-to-megatron", "--hf", str(tmp_path), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"HOME={tmp_path / 'a-file' / 'home'} is not writable and neither is" in err
