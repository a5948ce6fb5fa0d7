"""Summarise ``run_dcp_suite.sh``'s JUnit files: per file and mode the counts, then every test
whose outcome under our planners differs from DCP's own (with the first line of its error).

    python benchmarks/suites/dcp_suite_report.py OUT_DIR
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

MODES = ("default", "mithril", "mithril-all")


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed | failed | error | skipped, first line of the message)."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        tid = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        state, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                state = "failed" if tag == "failure" else tag
                text = (el.get("message") or el.text or "").strip()
                msg = next((ln for ln in text.splitlines() if ln.strip()), "")[:200]
                break
        out[tid] = (state, msg)
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    results: dict[str, dict[str, dict[str, tuple[str, str]]]] = defaultdict(dict)
    for xml in sorted(out_dir.glob("*.xml")):
        mode = next((m for m in sorted(MODES, key=len, reverse=True)
                     if xml.name.startswith(m + "-")), None)
        if mode is None:
            continue
        results[xml.name[len(mode) + 1:-4]][mode] = outcomes(xml)
    print("| file | mode | passed | failed | error | skipped |")
    print("|---|---|---|---|---|---|")
    for name, by_mode in sorted(results.items()):
        for mode in MODES:
            if mode not in by_mode:
                print(f"| {name} | {mode} | (no result: timed out or did not run) | | | |")
                continue
            counts = defaultdict(int)
            for state, _ in by_mode[mode].values():
                counts[state] += 1
            print(f"| {name} | {mode} | {counts['passed']} | {counts['failed']} | "
                  f"{counts['error']} | {counts['skipped']} |")
    print()
    for name, by_mode in sorted(results.items()):
        base = by_mode.get("default", {})
        for mode in MODES[1:]:
            for tid, (state, msg) in sorted(by_mode.get(mode, {}).items()):
                want = base.get(tid, ("absent", ""))[0]
                if state != want:
                    print(f"- {name} [{mode}] {tid}: {state} (DCP's planners: {want}) {msg}")
        for mode in MODES:
            for tid, (state, msg) in sorted(by_mode.get(mode, {}).items()):
                if state in ("failed", "error"):
                    print(f"  * {name} [{mode}] {tid}: {state}: {msg}")


if __name__ == "__main__":
    main()
