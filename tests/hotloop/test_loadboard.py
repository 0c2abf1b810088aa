"""hotloop/loadboard.py: the rollout's users' load in shared memory, written by one process and
read by another on the same host, and refused where it is not the replica's own."""

from __future__ import annotations

import subprocess
import sys

from hotloop.loadboard import LoadBoard, LoadReader


def test_a_reader_in_another_process_sees_each_write(tmp_path):
    board = LoadBoard(tmp_path)
    try:
        board.write(3, 1)
        code = (f"from hotloop.loadboard import LoadReader; r = LoadReader.open({str(board.path)!r}, "
                f"{board.nonce}); print(r.counts())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "(3, 1)"
        reader = LoadReader.open(str(board.path), board.nonce)
        board.write(2, 0)
        assert reader.counts() == (2, 0) and reader.waiting() == 0
        reader.close()
    finally:
        board.close()
    assert not board.path.exists()  # the rollout's stop removes it


def test_a_foreign_stale_or_missing_board_is_not_read(tmp_path):
    board = LoadBoard(tmp_path)
    try:
        assert LoadReader.open(str(board.path), board.nonce ^ 1) is None  # another replica's
        assert LoadReader.open(str(tmp_path / "absent"), board.nonce) is None  # another host
        assert LoadReader.open("", 0) is None  # the replica has none
        junk = tmp_path / "junk"
        junk.write_bytes(b"x" * 64)
        assert LoadReader.open(str(junk), 0) is None  # not a board
    finally:
        board.close()

