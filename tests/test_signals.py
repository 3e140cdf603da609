"""``terminate_on_sigterm``: SIGTERM ends a watched run cleanly while the run lasts, and acts as
the default action after it, whoever put the handler back; ``stop_on_signals``: a signal stops a
foreground command wherever its main thread is (real processes, real signals)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, signal, time
    from edo_monitor.signals import Terminated, terminate_on_sigterm

    restore = terminate_on_sigterm()
    {during}
    saved = signal.getsignal(signal.SIGTERM)  # a framework saves the handler at its start ...
    signal.signal(signal.SIGTERM, lambda *a: None)  # ... installs its own ...
    restore()  # (the run ends: its handler is not the monitor's, so it stays)
    signal.signal(signal.SIGTERM, saved)  # ... and puts the saved one back at its teardown
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print("still running")
    """
)


def _run(during: str) -> subprocess.CompletedProcess[str]:
    code = SCRIPT.format(during=during)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_during_the_run_sigterm_is_terminated() -> None:
    during = "try:\n    os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
    during += "except Terminated as exc:\n    print('terminated', exc.code)"
    res = _run(during)
    assert res.stdout.splitlines()[0] == "terminated 143"


def test_after_the_run_a_handler_put_back_acts_as_the_default_action() -> None:
    """Lightning put the monitor's handler back after the fit: a later SIGTERM raised
    ``Terminated`` (a SystemExit traceback) in code no run watched, instead of ending it."""
    res = _run("")
    assert res.returncode == -signal.SIGTERM, (res.returncode, res.stderr)
    assert res.stdout == "" and "Terminated" not in res.stderr


def test_a_later_run_takes_the_place_of_an_ended_runs_handler() -> None:
    """Regression: after a Lightning fit that raised (no teardown hook after Lightning put the
    ended run's handler back), a later run found a handler in place and installed none of its
    own: a SIGTERM then killed the process as the default action, and the later run read
    ``crashed``. An ended run's handler acts as the default action: the next run replaces it."""
    later = "restore_later = terminate_on_sigterm()\n"
    later += "try:\n    os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
    later += "except Terminated as exc:\n    print('later run terminated', exc.code)\n"
    later += "restore_later()\nprint(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    code = SCRIPT.replace("os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(5)", later, 1)
    res = subprocess.run(
        [sys.executable, "-c", code.format(during="")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.stdout.splitlines()[:2] == ["later run terminated 143", "True"], res.stderr


STOP_SCRIPT = textwrap.dedent(
    """
    import os, signal, threading
    from edo_monitor.signals import stop_on_signals

    stop, received = threading.Event(), []
    restore = stop_on_signals(stop, received)
    with stop._cond:  # where the main thread is inside stop.wait(): the event's lock held
        os.kill(os.getpid(), signal.{name})
        busy = sum(range(1000))  # bytecodes: Python runs the handler here
    print(stop.wait(30), received == [signal.{name}])
    restore()
    print(signal.getsignal(signal.{name}) is signal.{default})
    """
)


@pytest.mark.parametrize(
    ("name", "default"), [("SIGINT", "default_int_handler"), ("SIGTERM", "SIG_DFL")]
)
def test_a_signal_stops_a_command_while_its_main_thread_holds_the_events_lock(
    name: str, default: str
) -> None:
    """Regression: the handler set the event itself; a signal that came while the main thread
    was inside ``stop.wait()`` (the event's lock held) waited forever for that lock: the daemon
    at 0.02 s, sent SIGINT, hung in CI."""
    code = STOP_SCRIPT.format(name=name, default=default)
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "True", "True"]
