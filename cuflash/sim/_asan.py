"""Running simulator code under AddressSanitizer in a child Python.

ASan's runtime must be the first library of a process, so an asan-mode library
cannot be loaded into an ordinary interpreter. run_in_asan_subprocess() starts
a child Python with libasan preloaded, runs a picklable function there inside
``checking("asan")`` and brings back its return value, or re-raises its
exception (a KernelError stays a KernelError) in the parent.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from ._launch import KernelError

# halt_on_error=0 + -fsanitize-recover=address: a report comes back to us (as a
# KernelError) instead of killing the child. Python itself is not instrumented and
# its allocations are not leaks we care about.
ASAN_OPTIONS = ":".join(
    [
        "halt_on_error=0",
        "detect_leaks=0",
        "detect_stack_use_after_return=0",
        "allow_user_segv_handler=1",
        "color=never",
        "print_summary=1",
    ]
)

_CHILD = r"""
import pickle, sys, traceback
payload_path, result_path = sys.argv[1], sys.argv[2]
with open(payload_path, "rb") as f:
    path = pickle.load(f)  # first: the parent's sys.path, so fn's module can be imported
    sys.path[:0] = [p for p in path if p not in sys.path]
    fn, args, kwargs = pickle.load(f)
import cuflash.sim as sim
try:
    with sim.checking("asan"):
        outcome = ("ok", fn(*args, **kwargs))
except BaseException as exc:  # everything goes back to the parent
    try:
        pickle.dumps(exc)
        outcome = ("error", exc)
    except Exception:
        outcome = ("error", RuntimeError("".join(traceback.format_exception(exc))))
with open(result_path, "wb") as f:
    pickle.dump(outcome, f)
"""


def asan_runtime_path() -> str:
    cxx = os.environ.get("CXX", "g++")
    path = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True, check=True).stdout
    path = path.strip()
    if not os.path.isabs(path):
        raise RuntimeError(f"{cxx} does not ship libasan.so (got {path!r})")
    return path


def run_in_asan_subprocess(fn: Callable[..., Any], *args: Any, timeout: float = 600.0, **kwargs: Any) -> Any:
    """Call fn(*args, **kwargs) in a child Python running the simulator in asan mode.

    fn must be picklable by reference (a module-level function; test modules work
    because the child gets the parent's sys.path). Returns fn's result; re-raises
    its exception. If the child dies without reporting (a crash ASan did not
    recover from), raises KernelError when its stderr holds an ASan report,
    RuntimeError otherwise.
    """
    env = dict(os.environ)
    preload = asan_runtime_path()
    env["LD_PRELOAD"] = preload + (" " + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env["ASAN_OPTIONS"] = ASAN_OPTIONS + (":" + env["ASAN_OPTIONS"] if env.get("ASAN_OPTIONS") else "")
    env["CUFLASH_SIM_MODE"] = "asan"
    with tempfile.TemporaryDirectory(prefix="cuflash-asan-") as tmp:
        payload = Path(tmp) / "payload.pkl"
        result = Path(tmp) / "result.pkl"
        with open(payload, "wb") as f:
            pickle.dump(list(sys.path), f)
            pickle.dump((fn, args, kwargs), f)
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(payload), str(result)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.exists():
            with open(result, "rb") as f:
                status, value = pickle.load(f)
            if status == "ok":
                return value
            raise value
    stderr = proc.stderr[-6000:]
    if "AddressSanitizer" in stderr:
        raise KernelError("?", f"the asan child exited with status {proc.returncode}:\n{stderr}")
    raise RuntimeError(f"the asan child exited with status {proc.returncode} without a result:\n{stderr}")
