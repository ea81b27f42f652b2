"""The test lanes from measured durations: which tests a ``--durations=0`` run found over the slow threshold but are
not marked ``slow`` (and the reverse), each lane's summed time (``make test``'s fast and slow lanes, and the post-suite
lane: the tests marked ``post_suite``, which ``make test`` leaves out and need no ``slow`` mark), and the slowest tests.

    python -m pytest -q -p no:randomly --durations=0 --durations-min=0 tests > durations.txt   # the whole suite
    python benchmarks/lane_durations.py durations.txt [--threshold 3] [--top 30]

A test's duration is its setup plus its call (pytest's own lines; a module-scoped fixture's cost lands in the setup of
the first test that uses it, so every test of that fixture goes to the same lane). Which tests there are and which
are marked ``slow`` comes from ``pytest --collect-only`` run here; a measured test that is not collected any more
(renamed, removed, or a docs block whose line moved) is listed apart. Exit status 1 when a test over the threshold
is not marked slow (but those of ``KEPT_FAST``): mark it (``@pytest.mark.slow``, ``pytest.param(...,
marks=pytest.mark.slow)`` or the module's ``pytestmark``) and rerun. benchmarks/test-durations.txt holds the
measured lines of the last whole-suite run (the phases of 0.01 s or more); docs/architecture.md, Tests.
"""
import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: tests over the threshold kept in the fast lane on purpose: the lane's only test of a module (of lightning_amp, what
#: ``pytest -m "not slow" --called-modules=FILE`` reports NOT CALLED without it, or of make gpu-check's gpu_check/)
KEPT_FAST = {
    "tests/bench/test_gpu_check.py::test_the_pytest_plugin_records_each_outcome_as_it_comes":
        "gpu_check.pytest_log",
}
LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S.*?)\s*$")


def read_durations(path: str) -> dict:
    """{node id: {"setup"|"call"|"teardown": seconds}} of pytest's ``--durations`` lines in ``path``."""
    found = collections.defaultdict(dict)
    for line in Path(path).read_text().splitlines():
        match = LINE.match(line)
        if match:
            found[match.group(3)][match.group(2)] = float(match.group(1))
    return dict(found)


def collected(*marks: str) -> set:
    """The node ids this tree's pytest collects (``marks``: e.g. ``-m slow``)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *marks,
                           "tests"], cwd=ROOT, capture_output=True, text=True)
    ids = {line.strip() for line in done.stdout.splitlines() if "::" in line}
    if done.returncode != 0 or not ids:
        sys.exit(f"pytest --collect-only {' '.join(marks)} failed ({done.returncode}):\n"
                 f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return ids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("durations", help="the output of a --durations=0 --durations-min=0 run of the whole suite")
    parser.add_argument("--threshold", type=float, default=3.0, help="seconds of setup + call that make a test slow")
    parser.add_argument("--top", type=int, default=30, help="how many of the slowest tests to list")
    args = parser.parse_args(argv)

    phases = read_durations(args.durations)
    if not phases:
        sys.exit(f"{args.durations}: no --durations lines")
    cost = {test: p.get("setup", 0.0) + p.get("call", 0.0) for test, p in phases.items()}
    total = {test: sum(p.values()) for test, p in phases.items()}
    everything, post = collected(), collected("-m", "post_suite")
    slow = collected("-m", "slow") - post
    gone = sorted((t for t in cost if t not in everything), key=cost.get, reverse=True)
    unmarked = sorted((t for t in cost if cost[t] > args.threshold and t in everything and t not in slow | post
                       and t not in KEPT_FAST), key=cost.get, reverse=True)
    light = sorted((t for t in slow if t in cost and cost[t] <= args.threshold), key=cost.get, reverse=True)
    lanes = {"fast": everything - slow - post, "slow": slow, "post-suite (make test-post)": post}
    for lane, tests in lanes.items():
        print(f"{lane} lane: {len(tests)} tests collected; {sum(total.get(t, 0.0) for t in tests):.0f} s summed over "
              f"those measured")
    print(f"\nthe {args.top} slowest (setup + call):")
    for test in sorted(cost, key=cost.get, reverse=True)[:args.top]:
        lane = "gone" if test not in everything else "post" if test in post else "slow" if test in slow else "FAST"
        print(f"  {cost[test]:8.2f} s  {lane}  {test}")
    print(f"\nmarked slow, measured at or under {args.threshold} s (a shared fixture, or marks to drop): {len(light)}")
    for test in light:
        print(f"  {cost[test]:8.2f} s  {test}")
    print(f"\nover {args.threshold} s, kept fast on purpose (KEPT_FAST): {len(KEPT_FAST)}")
    for test, module in KEPT_FAST.items():
        print(f"  {cost.get(test, float('nan')):8.2f} s  {test}: the fast lane's only test of {module}")
    print(f"\nmeasured but not collected any more: {len(gone)}")
    for test in gone:
        print(f"  {cost[test]:8.2f} s  {test}")
    print(f"\nover {args.threshold} s and not marked slow: {len(unmarked)}")
    for test in unmarked:
        print(f"  {cost[test]:8.2f} s  {test}")
    return 1 if unmarked else 0


if __name__ == "__main__":
    sys.exit(main())
