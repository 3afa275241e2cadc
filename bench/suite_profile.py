"""Where the test suite's time goes: wall time, CPU time, interpreter starts, per-file durations.

Runs pytest (the arguments after `--`; default: what launch/test.sh runs for the whole
suite, the SLURM tests aside, which it runs beside) and prints the figures docs/benchmarks.md
keeps, side by side for saved runs:

    DEL_COLD_RANKS=1 .venv/bin/python bench/suite_profile.py --out runs/cold.json -- \
        --ignore=tests/slurm
    .venv/bin/python bench/suite_profile.py --out runs/warm.json
    .venv/bin/python bench/suite_profile.py --compare runs/cold.json runs/warm.json

* wall: the pytest run's elapsed time;
* CPU: the machine's busy CPU seconds over the run (/proc/stat, every process: a test's
  ranks, their launchers, a fork server, all counted; so the machine should be otherwise idle);
* interpreter starts: every Python interpreter of this environment started under the run,
  counted by a `.pth` file this script puts into the environment's site-packages for the run
  and removes after it (a `.pth` line runs at every start of that environment's interpreter);
* per file: the sum of its tests' durations (setup, call and teardown) from pytest's JUnit XML.
"""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARGS = ["--ignore=tests/slurm", "-n", "2", "--dist", "loadfile"]
COUNTER = "del_suite_profile_starts.pth"
# one line: .pth lines that start with `import` are executed at every interpreter start
# one line: .pth lines that start with `import` are executed at every interpreter start; the
# test that started it is in PYTEST_CURRENT_TEST (pytest sets it, subprocesses inherit it)
COUNTER_LINE = (
    "import os; p = os.environ.get('DEL_SUITE_STARTS'); "
    "p and open(p, 'a').write(os.environ.get('PYTEST_CURRENT_TEST', '-').split('::')[0] "
    "+ chr(10))\n"
)


def busy_cpu_seconds() -> float:
    """Busy CPU time of the whole machine since boot (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def per_file(junit: Path) -> dict[str, float]:
    durations: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")
        # classname is tests.pkg.test_module[.Class]: the file is the part up to test_*
        parts = []
        for part in name:
            parts.append(part)
            if part.startswith("test_"):
                break
        durations["/".join(parts) + ".py"] += float(case.get("time", 0))
    return dict(durations)


def counts(junit: Path) -> dict[str, int]:
    suites = list(ET.parse(junit).getroot().iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures",
                                                                      "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def profile(pytest_args: list[str]) -> dict:
    packages = Path(site.getsitepackages()[0])
    counter = packages / COUNTER
    with tempfile.TemporaryDirectory() as scratch:
        starts = Path(scratch) / "starts"
        junit = Path(scratch) / "junit.xml"
        counter.write_text(COUNTER_LINE)
        try:
            env = dict(os.environ, DEL_SUITE_STARTS=str(starts))
            cpu0, wall0 = busy_cpu_seconds(), time.monotonic()
            status = subprocess.call(
                [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                 f"--junitxml={junit}", *pytest_args],
                cwd=ROOT,
                env=env,
            )
            wall, cpu = time.monotonic() - wall0, busy_cpu_seconds() - cpu0
        finally:
            counter.unlink(missing_ok=True)
        started = starts.read_text().splitlines() if starts.exists() else []
        by_file: dict[str, int] = defaultdict(int)
        for where in started[1:]:  # the first is pytest's own
            by_file[where] += 1
        return {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "pytest_args": pytest_args,
            "exit_status": status,
            "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1),
            "interpreter_starts": len(started) - 1,  # less pytest's own
            "interpreter_starts_by_file": dict(sorted(by_file.items(), key=lambda i: -i[1])),
            "cores": os.cpu_count(),
            "tests": counts(junit),
            "files": {k: round(v, 1) for k, v in sorted(per_file(junit).items())},
        }


def show(runs: list[tuple[str, dict]], top: int) -> None:
    names = [name for name, _ in runs]
    width = max(len(n) for n in names) + 2
    print(f"{'':44}" + "".join(f"{n:>{width}}" for n in names))
    for key in ("wall_s", "cpu_s", "interpreter_starts"):
        print(f"{key:44}" + "".join(f"{r[key]:>{width}}" for _, r in runs))
    for key in ("passed", "skipped", "failures", "errors"):
        print(f"{'tests ' + key:44}" + "".join(f"{r['tests'][key]:>{width}}" for _, r in runs))
    first = runs[0][1]
    for key in ("wall_s", "cpu_s"):
        label = f"ratio {key[:-2]} (to the first)"
        print(f"{label:44}" + "".join(f"{r[key] / first[key]:>{width}.3f}" for _, r in runs))
    files = sorted(
        {f for _, r in runs for f in r["files"]}, key=lambda f: -runs[0][1]["files"].get(f, 0)
    )
    print(f"\nper-file durations (s) and interpreter starts, the {top} slowest of the first run:")
    for f in files[:top]:
        print(f"{f:60}" + "".join(
            f"{r['files'].get(f, 0):>10.1f}{r.get('interpreter_starts_by_file', {}).get(f, 0):>6}"
            for _, r in runs
        ))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write this run's figures here (JSON)")
    parser.add_argument("--compare", type=Path, nargs="+", help="show saved runs side by side")
    parser.add_argument("--top", type=int, default=40, help="files listed (default 40)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args(argv)
    if args.compare:
        show([(p.stem, json.loads(p.read_text())) for p in args.compare], args.top)
        return 0
    result = profile(args.pytest_args or DEFAULT_ARGS)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    show([("this run", result)], args.top)
    return result["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
