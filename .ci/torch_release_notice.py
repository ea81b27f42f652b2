"""Notice a torch release newer than CI's ceiling lane, so that we find it before users do.

    python .ci/torch_release_notice.py [--timeout SECONDS]

Asks the package index that pip is configured with (``pip index versions torch``: final releases with a wheel
for this interpreter and platform; pip's constraints do not apply to it) for its newest torch, and prints one
line when that release is newer than ``.ci/torch-releases``' ``TORCH_NEWEST``: a newer minor release (outside
``pyproject.toml``'s range too) or a newer patch of the ceiling's minor. It prints nothing when the ceiling is
the newest. A torch release must not fail an unrelated change: the exit status is always 0, and an index that
does not answer within the timeout (default 60 s; pip's own per-request timeout is 10 s, no retries) or an
answer without versions gets one line saying so instead.
"""
import argparse
import os
import re
import subprocess
import sys
from typing import Optional, Sequence, Tuple

RELEASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch-releases")
PREFIX = "torch release check:"

Release = Tuple[int, ...]


def release(version: str) -> Release:
    """The release numbers of a version string, three at least ("2.15.0+cu132" -> (2, 15, 0), "2.16" -> (2, 16, 0))."""
    numbers = tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version).group(0).split("."))
    return numbers + (0,) * (3 - len(numbers))


def ceiling(path: str = RELEASES) -> str:
    """``TORCH_NEWEST`` as ``.ci/torch-releases`` sets it."""
    return re.search(r"^TORCH_NEWEST=(\S+)$", open(path).read(), re.M).group(1)


def newest_listed(pip_output: str) -> Optional[str]:
    """The newest version on the "Available versions:" line of ``pip index versions``; None without one."""
    match = re.search(r"^Available versions: (.+)$", pip_output, re.M)
    if not match:
        return None
    return max((v.strip() for v in match.group(1).split(",")), key=release)


def notice(newest: str, newest_lane: str) -> Optional[str]:
    """The line to print when ``newest`` (the index's) is a newer release than ``newest_lane``, else None."""
    found, lane = release(newest), release(newest_lane)
    if found <= lane:
        return None
    where = ("a newer minor release: raise pyproject.toml's torch ceiling and TORCH_NEWEST"
             if found[:2] > lane[:2] else "a newer patch release: move TORCH_NEWEST to it")
    return (f"{PREFIX} NOTICE: the package index holds torch {newest}, newer than the ceiling lane's "
            f"{newest_lane} (.ci/torch-releases TORCH_NEWEST); {where}, and run the lanes under it.")


def ask_index(timeout: float) -> Tuple[Optional[str], str]:
    """(newest torch the index lists, None if it did not answer; why not, when it did not)."""
    command = [sys.executable, "-m", "pip", "index", "versions", "torch", "--timeout", "10", "--retries", "0",
               "--disable-pip-version-check"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"the package index did not answer within {timeout:g} s"
    newest = newest_listed(proc.stdout)
    if newest is None:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"pip index versions torch listed no versions (exit status {proc.returncode}: {last})"
    return newest, ""


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the index (default 60)")
    args = parser.parse_args(argv)
    lane = ceiling()
    newest, why_not = ask_index(args.timeout)
    if newest is None:
        print(f"{PREFIX} skipped, {why_not}; the ceiling lane runs torch {lane}")
        return 0
    line = notice(newest, lane)
    if line:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
