"""Summarise ``run_orbax_suite.sh``'s JUnit files: counts per file and mode, every test whose
outcome with our handlers differs from its outcome with Orbax's (same test method, matched by
name), and every failure with the first line of its message.

    python benchmarks/suites/orbax_site/report.py OUT_DIR
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dcp_suite_report import outcomes as dcp_outcomes  # the JUnit parsing, shared

MODES = ("orbax", "mithril")


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """test method (class name dropped: ours are subclasses) -> (state, first line)."""
    return {tid.rsplit(".", 1)[-1]: v for tid, v in dcp_outcomes(xml).items()}


def main() -> None:
    out_dir = Path(sys.argv[1])
    results: dict[str, dict[str, dict[str, tuple[str, str]]]] = {}
    for xml in sorted(out_dir.glob("*.xml")):
        mode, _, name = xml.stem.partition("-")
        if mode in MODES:
            results.setdefault(name, {})[mode] = outcomes(xml)
    print("| file | mode | passed | failed | error | skipped |")
    print("|---|---|---|---|---|---|")
    for name, by_mode in sorted(results.items()):
        for mode in MODES:
            if mode not in by_mode:
                print(f"| {name} | {mode} | (no result: timed out or did not run) | | | |")
                continue
            c = Counter(state for state, _ in by_mode[mode].values())
            print(f"| {name} | {mode} | {c['passed']} | {c['failed']} | {c['error']} | "
                  f"{c['skipped']} |")
    print()
    for name, by_mode in sorted(results.items()):
        theirs, ours = by_mode.get("orbax", {}), by_mode.get("mithril", {})
        for test in sorted(set(theirs) | set(ours)):
            a, b = theirs.get(test, ("absent", "")), ours.get(test, ("absent", ""))
            if a[0] != b[0]:
                print(f"- {name} {test}: orbax {a[0]}, mithril {b[0]}: {b[1] or a[1]}")
    print()
    for name, by_mode in sorted(results.items()):
        for mode in MODES:
            for test, (state, msg) in sorted(by_mode.get(mode, {}).items()):
                if state in ("failed", "error"):
                    print(f"  * {name} [{mode}] {test}: {state}: {msg}")


if __name__ == "__main__":
    main()
