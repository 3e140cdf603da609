"""Command lines of training scripts (the examples, or yours): checked arguments, one-line errors.

The examples in ``examples/`` share this instead of each checking its own way, and follow the
exit codes of the ``edo-monitor`` CLI:

* **2** — a bad argument, found while parsing, before anything is read, built or opened:
  :class:`ArgumentParser` prints ``prog: error: argument --budget: 'abc' is not a size; …`` on one
  line (argparse's own prints the usage first), and the ``type=`` functions here name the value
  and what is allowed;
* **1** — a history database that cannot be used (not a database, from a newer edo-monitor,
  read-only), or another :class:`~edo_monitor.errors.EdoMonitorError`, caught by :func:`run_main`
  and printed as one line; :func:`check_history_db` finds these before training starts;
* **130** — Ctrl-C: ``prog: interrupted`` (``watch()`` has already recorded the run as
  ``interrupted``).

Nothing here prints anything except :class:`ArgumentParser` and :func:`run_main`, which are the
script's output; importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from edo_monitor.errors import ConfigError, EdoMonitorError
from edo_monitor.units import STORABLE_BYTES, format_bytes, parse_bytes

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "ArgumentParser",
    "budget_below_params",
    "byte_size",
    "check_history_db",
    "history_db",
    "positive_float",
    "positive_int",
    "readable_file",
    "run_main",
    "torch_device",
]

#: exit codes, as the ``edo-monitor`` CLI's (README "Exit codes")
EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr, exit code 2.

    argparse prints the whole usage before the error; a script with a dozen options buries the
    one line that matters. ``--help`` still prints the usage.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # "--budget -5MiB" gets byte_size's one line ("expected a positive size"), as "--budget
        # 0": argparse before Python 3.14 reads only "-5" and "-.5" as negative numbers and took
        # "-5MiB" for an unknown option ("argument --budget: expected one argument"); this is
        # 3.14's own test, "-" then a digit (no option of the examples looks like that)
        self._negative_number_matcher = re.compile(r"-\.?\d")

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message`` and exit with code 2 (called by argparse)."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (--help lists the options)\n")

    def add_history_and_budget(self, budget_help: str) -> None:
        """The examples' ``--db`` (:func:`history_db`) and ``--budget`` (:func:`byte_size`)."""
        self.add_argument(
            "--db",
            type=history_db,
            default=None,
            help="history database (default: ./edo-history.db)",
        )
        self.add_argument("--budget", type=byte_size, default=None, help=budget_help)


def byte_size(text: str) -> int:
    """``type=`` for a memory budget: a positive size, ``"158MiB"``, ``"2GB"``, ``"4096"`` (bytes).

    Units as :func:`edo_monitor.units.parse_bytes` reads them (KiB… powers of 1024, KB… of 1000).

    Raises:
        argparse.ArgumentTypeError: not a size, negative, or 0.
    """
    allowed = "expected a positive size such as 158MiB, 2GB, 1.5GiB or 4096 (bytes)"
    try:
        size_bytes = parse_bytes(text)
    except ConfigError:
        problem = "is negative" if _is_negative_size(text) else "is not a size"
        raise argparse.ArgumentTypeError(f"{text!r} {problem}; {allowed}") from None
    if size_bytes <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} leaves no memory; {allowed}")
    if size_bytes > STORABLE_BYTES:  # what watch() refuses, refused before anything is read
        raise argparse.ArgumentTypeError(
            f"{text!r} is {size_bytes} bytes; expected less than 2**63 bytes (8 EiB), the "
            "largest size the history stores"
        )
    return size_bytes


def _is_negative_size(text: str) -> bool:
    """Whether ``text`` is a size with a minus sign (``"-5MiB"``), which ``parse_bytes`` refuses."""
    body = text.strip()
    if not body.startswith("-"):
        return False
    try:
        parse_bytes(body[1:])
    except ConfigError:
        return False
    return True


def positive_int(text: str) -> int:
    """``type=`` for a count (steps, epochs, batch size …): an int ≥ 1.

    Raises:
        argparse.ArgumentTypeError: not an int, or < 1.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number; expected 1 or more"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is too small; expected 1 or more")
    return value


def positive_float(text: str) -> float:
    """``type=`` for a duration in seconds: a finite number > 0.

    Raises:
        argparse.ArgumentTypeError: not a number, not finite, or ≤ 0.
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds > 0; expected e.g. 0.25"
        )
    return value


def readable_file(text: str) -> Path:
    """``type=`` for an input file: an existing file this process can read.

    Raises:
        argparse.ArgumentTypeError: missing, a folder, or not readable (the reason from the OS).
    """
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist; expected a readable file")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; expected a readable file")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot be read ({exc.strerror}); expected a readable file"
        ) from None
    return path


def torch_device(text: str) -> str:
    """``type=`` for a training device: ``cpu``, ``cuda`` or ``cuda:N``, usable here.

    Returns ``text`` unchanged. Imports torch.

    Raises:
        argparse.ArgumentTypeError: not a device name, another device type, ``cuda`` on a
            PyTorch without CUDA or a machine without a visible GPU, ``cuda:N`` beyond the
            visible devices.
    """
    import torch

    allowed = "expected cpu, cuda or cuda:N"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; {allowed}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not supported here; {allowed}")
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise argparse.ArgumentTypeError(
                f"{text!r}: this PyTorch ({torch.__version__}) is built without CUDA; "
                "use --device cpu"
            )
        count = torch.cuda.device_count()
        if count == 0:
            raise argparse.ArgumentTypeError(
                f"{text!r}: no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES); "
                "use --device cpu"
            )
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {count} CUDA device(s) visible; expected cuda:0 to cuda:{count - 1}"
            )
    return text


def history_db(text: str) -> str:
    """``type=`` for a history database a run writes to: a file path or an SQLAlchemy URL.

    Checks the value only (a folder, a missing folder, a URL naming no installed dialect, an
    in-memory database); :func:`check_history_db` opens it. Returns ``text`` unchanged.

    Raises:
        argparse.ArgumentTypeError: the value can never be a history database.
    """
    from edo_monitor.store.paths import database_file, resolve_db_url

    try:
        url = resolve_db_url(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if url.get_backend_name() == "sqlite" and database_file(url) is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is an in-memory database; expected a file path or a server URL"
        )
    return text


def budget_below_params(budget_bytes: int | None, model: Any) -> str | None:
    """Why ``--budget`` cannot hold ``model``, or ``None`` when it can (or there is no budget).

    ``model`` is a ``torch.nn.Module``; one built under ``torch.device("meta")`` (shapes only, no
    memory) is enough. The answer is ``"--budget 1 MiB is smaller than the model's parameters
    (24.92 MiB)"`` when the budget is below the bytes of its parameters: the script prints it
    with its own advice and exits with code 2, before the slow work (``watch()`` would only
    warn, or with ``enforce=True`` refuse when the run starts).
    """
    if budget_bytes is None:
        return None
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if budget_bytes >= model_bytes:
        return None
    return (
        f"--budget {format_bytes(budget_bytes)} is smaller than the model's parameters "
        f"({format_bytes(model_bytes)})"
    )


def check_history_db(db: str | os.PathLike[str] | None) -> None:
    """Open the history database as ``watch(db=db)`` will, create or upgrade its tables, close.

    Call it after parsing, before the slow work (reading data, building the model), so that a
    database that cannot be used stops the script at once (exit code 1 through
    :func:`run_main`) instead of when the run starts. ``None``: ``$EDO_DB`` or
    ``./edo-history.db``, as ``watch()``.

    Raises:
        ConfigError: a bad value (see :func:`edo_monitor.store.engine.resolve_db_url`).
        StoreError: the file or its folder is read-only, it is not an SQLite database or not an
            edo-monitor one, it comes from a newer edo-monitor, or the server cannot be reached.
    """
    from edo_monitor.store.engine import open_engine
    from edo_monitor.store.paths import check_writable, resolve_db_url

    url = resolve_db_url(db)
    check_writable(url)
    open_engine(url).dispose()


def run_main(main: Callable[[], int], *, prog: str | None = None) -> int:
    """Run a script's ``main()`` and turn what a user can cause into one line and an exit code.

    Returns ``main()``'s exit code; ``2`` after a :class:`~edo_monitor.errors.ConfigError` (a
    bad value found late), ``1`` after another
    :class:`~edo_monitor.errors.EdoMonitorError` (a history database that cannot be used …),
    ``130`` after Ctrl-C. The line goes to stderr as ``prog: error: <message>`` or
    ``prog: interrupted``; any other exception propagates with its traceback (a bug).
    """
    prog = prog or Path(sys.argv[0]).name
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except EdoMonitorError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
