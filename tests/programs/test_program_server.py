"""A program forked from the program server (``helpers.programs``) sees what a fresh start of it sees.

Each case runs one program both ways, with the same arguments, environment and
directory, and compares what it printed and how it ended: its ``__main__``, ``argv``,
whole ``sys.path``, directory, environment, standard streams, exit hooks and status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import programs
from helpers.isolation import Isolation

REPORT = """
import atexit, json, os, sys
main = sys.modules["__main__"]
spec = getattr(main, "__spec__", None)
atexit.register(lambda: print("exit hook ran", flush=True))
print(json.dumps({
    "name": __name__, "spec": spec.name if spec else None, "argv": sys.argv, "path": sys.path,
    "cwd": os.getcwd(), "env": os.environ.get("METRALE_TEST_WORD"), "stdin": sys.stdin.read(),
    "session": os.getsid(0) == os.getpid(), "streams": [sys.stdout.write_through, sys.stderr.line_buffering],
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[-1]))
"""


def both(argv: list[str], cwd: Path, **variables: str) -> tuple[subprocess.CompletedProcess[str], ...]:
    """``argv`` run afresh, then forked from the program server: each result, stdout and stderr captured."""
    env = {**os.environ, "METRALE_TEST_WORD": "hello", **variables}
    fresh = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=60, check=False)
    forked = programs.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    return fresh, forked


def test_a_script_sees_what_a_fresh_start_sees(tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    fresh, forked = both([sys.executable, str(script), "an argument", "3"], tmp_path.parent)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 3 and '"name": "__main__"' in fresh.stdout and "exit hook ran" in fresh.stdout


def test_a_module_run_with_m_sees_what_a_fresh_start_sees(tmp_path: Path) -> None:
    (tmp_path / "report_module.py").write_text(REPORT)
    fresh, forked = both([sys.executable, "-m", "report_module", "0"], tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 0 and '"spec": "report_module"' in fresh.stdout


def test_code_run_with_c_sees_what_a_fresh_start_sees(tmp_path: Path) -> None:
    fresh, forked = both([sys.executable, "-c", REPORT, "one", "2"], tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 2 and '"argv": ["-c", "one", "2"]' in fresh.stdout


def test_an_unbuffered_program_writes_through_as_a_fresh_one_does(tmp_path: Path) -> None:
    fresh, forked = both([sys.executable, "-c", REPORT, "0"], tmp_path, PYTHONUNBUFFERED="1")
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert '"streams": [true, false]' in fresh.stdout


def test_a_variable_read_at_the_interpreters_start_is_refused_naming_it() -> None:
    env = {**os.environ, "PYTHONHASHSEED": "1234"}
    with pytest.raises(ValueError, match=r"\['PYTHONHASHSEED'\] set otherwise than the program server's start"):
        programs.Popen([sys.executable, "-c", "pass"], env=env)


def test_a_program_in_its_own_session_killed_ends_with_the_signal_and_its_stderr_joins_stdout(tmp_path: Path) -> None:
    code = "import os, sys, time; print(os.getsid(0) == os.getpid(), flush=True); print('e', file=sys.stderr)"
    code += "; time.sleep(60)"
    process = programs.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, cwd=tmp_path,
    )  # fmt: skip
    assert process.stdout is not None
    assert [process.stdout.readline(), process.stdout.readline()] == ["True\n", "e\n"]
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.05)
    process.send_signal(signal.SIGKILL)
    started = time.monotonic()
    assert process.wait(10) == -signal.SIGKILL
    assert time.monotonic() - started < 5.0
    assert process.communicate() == ("", None)


def test_a_command_the_server_cannot_run_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"not this interpreter running a module \(-m\), code \(-c\) or a script"):
        programs.Popen([sys.executable, "-X", "dev", "script.py"])
    with pytest.raises(ValueError, match="'/bin/true'"):
        programs.Popen(["/bin/true", "x"])


NAMESPACES = """
import os, socket
print(os.getpid(), socket.gethostname(), os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not sys.platform.startswith("linux"), reason="namespaces need Linux and root")
def test_an_isolated_program_has_its_own_pid_namespace_hostname_and_dev_shm(tmp_path: Path) -> None:
    machine = os.statvfs("/dev/shm")
    isolation: Isolation = {"hostname": "elsewhere", "shm": "size=64k", "pid": True}
    done = programs.run(
        [sys.executable, "-c", NAMESPACES], capture_output=True, text=True, timeout=60, isolate=isolation
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, f"1 elsewhere {64 * 1024}\n", "")
    assert os.statvfs("/dev/shm").f_blocks == machine.f_blocks  # the machine's own, untouched


@pytest.mark.skipif(os.geteuid() != 0 or not sys.platform.startswith("linux"), reason="namespaces need Linux and root")
def test_an_isolation_that_fails_ends_the_program_before_it_runs_naming_the_namespace() -> None:
    done = programs.run(
        [sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=60,
        isolate={"netns": "metrale-no-such-namespace"},
    )  # fmt: skip
    assert done.returncode == 1 and done.stdout == "", done
    assert "/run/netns/metrale-no-such-namespace" in done.stderr.splitlines()[-1], done.stderr
