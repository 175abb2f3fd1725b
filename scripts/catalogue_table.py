#!/usr/bin/env python3
"""The bug table of docs/catalogue.md, generated from `lossverify list --json`.

usage: catalogue_table.py LOSSVERIFY_BINARY              print the table
       catalogue_table.py LOSSVERIFY_BINARY --check DOC  exit 1, with a diff, when DOC's table differs
The table is every catalogued implementation but `correct`, in the catalogue's order: name, summary,
source, and the checks that catch it.
"""
import difflib
import json
import subprocess
import sys

HEADER = ["| `--impl` | bug | source | caught by |", "|---|---|---|---|"]


def table(binary):
    listing = json.loads(subprocess.run([binary, "list", "--json"], capture_output=True, text=True, check=True).stdout)
    rows = [f"| `{i['name']}` | {i['summary']} | {i['source']} | {', '.join(i['caught_by'])} |"
            for i in listing["implementations"] if i["name"] != "correct"]
    return HEADER + rows


def documented(path):
    lines = open(path, encoding="utf-8").read().splitlines()
    start = lines.index(HEADER[0])
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def main(argv):
    if len(argv) == 2:
        print("\n".join(table(argv[1])))
        return 0
    if len(argv) == 4 and argv[2] == "--check":
        want, have = table(argv[1]), documented(argv[3])
        if want == have:
            print(f"{argv[3]}: the bug table matches `lossverify list` ({len(want) - 2} bugs)")
            return 0
        sys.stdout.writelines(difflib.unified_diff([l + "\n" for l in have], [l + "\n" for l in want],
                                                   argv[3], "lossverify list --json"))
        print(f"{argv[3]}: the bug table differs from `lossverify list`; regenerate it with {argv[0]} BINARY")
        return 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
