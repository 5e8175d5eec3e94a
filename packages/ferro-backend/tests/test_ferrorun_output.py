"""ferrorun's output: one prefix per line, progress bars (``\\r`` redraws) collapsed to their last
state off a terminal and animated on one, ``--log-dir`` files, unfinished lines flushed at exit,
bytes that are not text, and a pipe a stray child holds open."""

import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ferro_backend.errors import LauncherError
from ferro_backend.launch.output import MAX_LINE, Lines, LogDirError, prepare_log_dir

pytestmark = pytest.mark.timeout(90)
FERRORUN = [sys.executable, "-m", "ferro_backend.launch"]

# what tqdm writes: each redraw starts with \r; close() ends the bar with \n
BAR = r"""
import os, sys, time
rank = os.environ["RANK"]
print("start", rank, flush=True)
for i in range(0, 101, 25):
    sys.stderr.write(f"\r{i:3d}%|{'#' * (i // 10):<10}|")
    sys.stderr.flush()
    time.sleep(0.02)
sys.stderr.write("\n")
sys.stderr.write("warning " + rank + "\n")
sys.stdout.write("crlf line\r\n")
sys.stdout.flush()
sys.stdout.buffer.write(b"bytes \xff\xfe\x00 end\n")
sys.stdout.flush()
sys.stdout.write("tail without newline")
"""
FINAL = "100%|##########|"


def write(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def ferrorun(*args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([*FERRORUN, *map(str, args)], timeout=60, env=env, **kw)


def check_prefixed(lines: list[bytes], ranks: int) -> None:
    """Every line carries exactly one prefix, each rank's bar shows once at its last state."""
    for line in lines:
        assert line.startswith(b"[rank "), line
        assert line.count(b"[rank ") == 1, line
        assert b"\r" not in line, line
    for rank in range(ranks):
        mine = [line[len(f"[rank {rank}] "):] for line in lines
                if line.startswith(f"[rank {rank}] ".encode())]
        assert mine.count(FINAL.encode()) == 1, mine
        assert not any(b"25%" in m or b"75%" in m for m in mine), mine   # no earlier states
        for expected in (f"start {rank}", f"warning {rank}", "crlf line",
                         "tail without newline"):
            assert expected.encode() in mine, (expected, mine)
        assert b"bytes \xff\xfe\x00 end" in mine


def test_output_in_a_file_has_one_prefix_per_line_and_the_bar_at_its_last_state(tmp_path):
    script = write(tmp_path, "bar.py", BAR)
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        r = ferrorun("--nproc", "2", script, stdout=f, stderr=subprocess.STDOUT)
    assert r.returncode == 0, out.read_bytes()
    data = out.read_bytes()
    assert data.endswith(b"\n")   # the unfinished last line was ended
    check_prefixed(data.splitlines(), 2)


def test_output_to_pipes_and_log_dir_files(tmp_path):
    script = write(tmp_path, "bar.py", BAR)
    logs = tmp_path / "made" / "logs"   # missing, two levels: created
    r = ferrorun("--nproc", "2", "--log-dir", logs, script, capture_output=True)
    assert r.returncode == 0, r.stderr
    check_prefixed(r.stdout.splitlines() + [line for line in r.stderr.splitlines()
                                            if not line.startswith(b"ferrorun: ")], 2)
    assert b"warning" not in r.stdout and b"start" not in r.stderr   # streams stay apart
    for rank in (0, 1):
        out = (logs / f"rank_{rank}.stdout").read_bytes()
        err = (logs / f"rank_{rank}.stderr").read_bytes()
        both = (logs / f"rank_{rank}.log").read_bytes()
        assert out == (f"start {rank}\ncrlf line\n".encode() + b"bytes \xff\xfe\x00 end\n"
                       b"tail without newline\n")
        assert err == f"{FINAL}\nwarning {rank}\n".encode()
        assert sorted(both.splitlines()) == sorted(out.splitlines() + err.splitlines())
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        f"rank_{r}.{ext}" for r in (0, 1) for ext in ("log", "stdout", "stderr"))


def test_log_dir_is_emptied_by_a_run_and_appended_by_restarts(tmp_path):
    script = write(tmp_path, "flaky.py", """
        import os, sys
        attempt = os.environ["FERRO_RESTART_COUNT"]
        print("attempt", attempt, flush=True)
        sys.exit(3 if attempt == "0" else 0)
    """)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank_0.stdout").write_text("an older run\n")
    r = ferrorun("--nproc", "1", "--max-restarts", "1", "--log-dir", logs, script,
                 capture_output=True)
    assert r.returncode == 0, r.stderr
    assert (logs / "rank_0.stdout").read_text() == "attempt 0\nattempt 1\n"
    assert r.stdout.splitlines() == [b"[rank 0] attempt 0", b"[rank 0] attempt 1"]


def test_log_dir_that_cannot_be_made_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    script = write(tmp_path, "never.py", "open('ran', 'w').close()\n")
    r = ferrorun("--nproc", "1", "--log-dir", blocker / "logs", script, capture_output=True,
                 text=True, cwd=tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert f"--log-dir: cannot create the directory '{blocker / 'logs'}'" in r.stderr
    assert not (tmp_path / "ran").exists()
    with pytest.raises(LogDirError) as info:
        prepare_log_dir(blocker / "logs")
    assert isinstance(info.value, OSError) and isinstance(info.value, LauncherError)
    assert info.value.filename == str(blocker / "logs") and info.value.errno


def read_pty(master: int, proc: subprocess.Popen, deadline: float) -> bytes:
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:   # EIO: every writer is gone
                break
            if not chunk:
                break
            buf += chunk
        elif proc.poll() is not None:
            break
    return buf


def test_on_a_terminal_the_bar_animates_with_its_prefix(tmp_path):
    script = write(tmp_path, "bar.py", BAR)
    master, slave = pty.openpty()
    p = subprocess.Popen([*FERRORUN, "--nproc", "1", str(script)], stdout=slave, stderr=slave,
                         stdin=subprocess.DEVNULL)
    os.close(slave)
    try:
        buf = read_pty(master, p, time.monotonic() + 60)
        assert p.wait(timeout=10) == 0
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
            p.wait()
    for state in ("  0%|", " 25%|##", " 50%|#####", " 75%|#######", FINAL):
        assert f"[rank 0] {state}".encode() in buf   # every redraw, with its prefix
    text = buf.replace(b"\r\n", b"\n")   # the terminal's own line endings
    for segment in text.replace(b"\r", b"\n").split(b"\n"):
        if segment and not segment.startswith(b"ferrorun: "):
            assert segment.startswith(b"[rank 0] ") and segment.count(b"[rank") == 1, segment
    assert b"[rank 0] \r" not in text   # no prefix of its own for the empty bit before a \r
    assert text.endswith(b"[rank 0] tail without newline\n")


def test_a_pipe_held_open_by_a_stray_child_does_not_hang_and_the_line_is_flushed(tmp_path):
    pidfile = tmp_path / "stray.pid"
    script = write(tmp_path, "stray.py", f"""
        import subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True, stdin=subprocess.DEVNULL)
        open({str(pidfile)!r}, "w").write(str(p.pid))
        sys.stdout.write("unfinished")
    """)
    try:
        start = time.monotonic()
        r = ferrorun("--nproc", "1", script, capture_output=True)
        assert r.returncode == 0, r.stderr
        assert time.monotonic() - start < 30
        assert r.stdout == b"[rank 0] unfinished\n"
    finally:
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_reader_that_goes_away_does_not_block_the_ranks(tmp_path):
    # ferrorun ... | head -1: far more output than a pipe holds after the reader left
    script = write(tmp_path, "chatty.py", """
        for i in range(20000):
            print("line", i, "x" * 40)
        open("finished", "w").close()
    """)
    p = subprocess.Popen([*FERRORUN, "--nproc", "2", str(script)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=tmp_path)
    try:
        assert p.stdout.readline().startswith(b"[rank ")
        p.stdout.close()
        assert p.wait(timeout=60) == 0
        assert (tmp_path / "finished").exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("live", [False, True])
def test_lines_do_not_depend_on_how_the_output_was_cut(live):
    data = (b"one\n\r  0%|\r 50%|#\r100%|##\ntwo\r\nthree\r\r\n" + b"\xff\x00 bin\n"
            + b"\r  0%|\r" + b" " * 8 + b"\rnext\n")
    whole = Lines(b"[rank 3] ", live)
    ref = whole.feed(data) + whole.finish()
    byte = Lines(b"[rank 3] ", live)
    cut = b"".join(byte.feed(data[i:i + 1]) for i in range(len(data))) + byte.finish()
    if not live:
        expected = (b"[rank 3] one\n[rank 3] 100%|##\n[rank 3] two\n[rank 3] three\n"
                    b"[rank 3] \xff\x00 bin\n[rank 3] next\n")
        assert ref == cut == expected
    else:   # a terminal sees every state; byte by byte it sees more partial draws, no more
        for out in (ref, cut):
            assert b"[rank 3] \r" not in out and b"[rank 3] [rank 3]" not in out
            assert b"\r[rank 3]  50%|#\r" in out and out.endswith(b"[rank 3] next\n")


def test_an_endless_line_is_written_in_pieces_and_a_partial_line_at_exit_ends():
    lines = Lines(b"[rank 0] ", False)
    out = lines.feed(b"x" * (MAX_LINE + 10))
    assert out == b"[rank 0] " + b"x" * MAX_LINE + b"\n"
    assert lines.finish() == b"[rank 0] " + b"x" * 10 + b"\n"
    assert lines.finish() == b""
    assert Lines(b"[rank 0] ", False).feed(b"\r   \r") == b""
