#!/usr/bin/env python3
"""Writes python/lossverify/kind_settings.json, the kinds' settings tables as `lossverify list --json` gives them
(declared once, in each kind's C++ table), or with --check fails when the file and the binary disagree.

usage: scripts/kind_settings.py BINARY [--check [FILE]]
"""

import json
import pathlib
import subprocess
import sys

TARGET = pathlib.Path(__file__).resolve().parent.parent / "python" / "lossverify" / "kind_settings.json"


def tables(binary):
    listed = json.loads(subprocess.run([binary, "list", "--json"], check=True, capture_output=True, text=True).stdout)
    return {kind["name"]: kind["settings"] for kind in listed["losses"]}


def main(argv):
    if len(argv) not in (2, 3, 4) or (len(argv) > 2 and argv[2] != "--check"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    text = json.dumps(tables(argv[1]), indent=1, sort_keys=True) + "\n"
    if len(argv) > 2:
        target = pathlib.Path(argv[3]) if len(argv) == 4 else TARGET
        if not target.is_file() or target.read_text() != text:
            print(f"{target.name} differs from `lossverify list --json`: run scripts/kind_settings.py BINARY",
                  file=sys.stderr)
            return 1
        print(f"{target.name} matches the kinds' tables")
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
