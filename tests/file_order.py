"""The order the test files are handed to the pytest workers: the longest first.

.ci/run runs the suite on two xdist workers, a whole file to one worker (`--dist loadfile`), in collection
order (`--no-loadscope-reorder`; xdist's own order is by number of tests, which put files of a few slow tests
last). A long file that starts last runs alone while the other worker idles; handing out the longest files
first (the longest-processing-time rule) leaves the short ones to even out the end.

The lengths are seconds per file from a cold run (tests/file_seconds.json); a file it does not list is
taken as the longest, so a new slow file cannot end up last. Refresh the table after adding or moving slow
tests:

    bash .ci/run --junitxml=/tmp/junit.xml -o junit_family=xunit1
    python -m tests.file_order /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

SECONDS = Path(__file__).with_name("file_seconds.json")


def file_seconds() -> dict[str, float]:
    return json.loads(SECONDS.read_text())["seconds"] if SECONDS.exists() else {}


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """`items` (pytest items) with each file's items kept together and in order, files by descending seconds;
    unknown files first, in collection order (the sort is stable)."""
    by_file: dict[str, list] = defaultdict(list)
    for item in items:
        by_file[item.nodeid.split("::", 1)[0]].append(item)
    order = sorted(by_file, key=lambda f: -seconds.get(f, float("inf")))
    return [item for f in order for item in by_file[f]]


def seconds_from_junit(path: Path) -> dict[str, float]:
    """Seconds per test file (set-up, call and tear-down of each test) from an xunit1 JUnit report."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file") or ""
        if not file.startswith("tests/"):  # schemathesis' generated tests name a file of its own package
            file = _file_of(case.get("classname", ""))
        totals[file] += float(case.get("time") or 0.0)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _file_of(classname: str) -> str:
    # xunit2 reports leave out `file`: tests.models.test_x.TestY -> tests/models/test_x.py
    parts = classname.split(".")
    module = next(i for i in range(len(parts), 0, -1) if parts[i - 1].startswith("test_"))
    return "/".join(parts[:module]) + ".py"


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m tests.file_order JUNIT.xml")
    seconds = {f: round(s, 1) for f, s in seconds_from_junit(Path(argv[0])).items()}
    measured = time.strftime("%Y-%m-%d", time.gmtime(Path(argv[0]).stat().st_mtime))
    SECONDS.write_text(json.dumps({"measured": measured, "seconds": seconds}, indent=1) + "\n")
    print(f"{len(seconds)} files, {sum(seconds.values()):.0f} s in all -> {SECONDS}")


if __name__ == "__main__":
    main(sys.argv[1:])
