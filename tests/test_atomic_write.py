"""host.files.atomic_write, the one writer of the product's files: whole files only, the mode
applied, no temporary file left, safe when two threads replace the same path."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest

from sparkguard import reload as reload_cmd
from sparkguard.host.files import atomic_write


def test_writes_str_and_bytes_with_the_mode_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        atomic_write(str(tmp_path / "a" / "b.txt"), "héllo\n", 0o644)
        atomic_write(str(tmp_path / "c.bin"), b"\x00\xff", 0o600)
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "b.txt").read_text(encoding="utf-8") == "héllo\n"
    assert stat.S_IMODE((tmp_path / "a" / "b.txt").stat().st_mode) == 0o644
    assert (tmp_path / "c.bin").read_bytes() == b"\x00\xff"
    assert stat.S_IMODE((tmp_path / "c.bin").stat().st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["a", "c.bin"]


def test_two_threads_replacing_one_path_never_leave_a_part_or_a_temp_file(tmp_path):
    path = str(tmp_path / "state.json")
    bodies = [json.dumps({"writer": w, "pad": "x" * (100_000 + w)}) for w in range(2)]
    seen: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(body: str) -> None:
        try:
            for _ in range(60):
                atomic_write(path, body)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    def reader() -> None:
        while not stop.is_set():
            try:
                with open(path, encoding="utf-8") as f:
                    seen.append(f.read())
            except FileNotFoundError:
                pass

    r = threading.Thread(target=reader)
    r.start()
    ws = [threading.Thread(target=writer, args=(b,)) for b in bodies]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    stop.set()
    r.join()
    assert not errors
    assert seen and all(s in bodies for s in seen)
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "f"
    atomic_write(str(path), "old")
    os.mkdir(tmp_path / "f.d")
    with pytest.raises(OSError):
        atomic_write(str(tmp_path / "f.d"), "new")   # rename over a directory fails
    assert path.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["f", "f.d"]
    assert os.listdir(tmp_path / "f.d") == []


def test_reload_result_is_written_through_it(tmp_path):
    reload_cmd.write_result(str(tmp_path), {"pid": 1, "ok": True})
    assert reload_cmd.read_result(str(tmp_path)) == {"pid": 1, "ok": True}
    assert stat.S_IMODE((tmp_path / "reload").stat().st_mode) == 0o644
    assert os.listdir(tmp_path) == ["reload"]
