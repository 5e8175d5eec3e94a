"""The emulation tests' machine-wide lock (ferro_backend.testing.exclusive) is taken in the
order processes ask for it: a test file that takes it for each of its tests cannot starve a
test of another lane (the lock polled every 0.1 s, and lost each time to a holder that took it
again within microseconds)."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ferro_backend.testing import exclusive
    who, folder = sys.argv[1], Path(sys.argv[2])
    exclusive.LOCK = folder / "lock"
    log, asked = folder / "log", folder / "asked"
    if who == "A":  # takes the lock again and again, as test_emulate.py's tests do
        with exclusive.one_emulation_at_a_time(60):
            print("HOLDING", flush=True)
            end = time.monotonic() + 60
            while not asked.exists() and time.monotonic() < end:
                time.sleep(0.01)
            time.sleep(0.3)  # B is waiting now
        for _ in range(10):
            with exclusive.one_emulation_at_a_time(60):
                with open(log, "a") as f:
                    f.write("A")
                time.sleep(0.05)
    else:
        asked.touch()
        with exclusive.one_emulation_at_a_time(60):
            with open(log, "a") as f:
                f.write("B")
""")


def test_a_process_asking_for_the_lock_gets_it_before_a_holder_takes_it_again(tmp_path):
    script = tmp_path / "taker.py"
    script.write_text(SCRIPT)
    a = subprocess.Popen([sys.executable, str(script), "A", str(tmp_path)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert a.stdout.readline().strip() == "HOLDING"
        b = subprocess.run([sys.executable, str(script), "B", str(tmp_path)], timeout=90)
        assert b.returncode == 0 and a.wait(90) == 0
    finally:
        a.kill()
        a.wait(10)
    assert (tmp_path / "log").read_text() == "B" + "A" * 10  # B was first in line
    assert not list(tmp_path.glob("lock.ticket.*"))  # every ticket was taken back
