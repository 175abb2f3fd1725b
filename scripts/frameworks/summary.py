#!/usr/bin/env python3
"""Writes docs/frameworks.md from the judgements kept as data (scripts/frameworks/results/*.json).

usage: python3 scripts/frameworks/summary.py [--check] [--page PAGE] [--results DIR]
Each results file holds one framework at one commit: its summary lines, its sections (text, result tables,
findings) and its minimal reproducers. page.md in the results folder is the hand-written frame: the intro and
one {{section FILE#ID}} line per section, in page order; {{summary training FILE ...}} and {{summary rl FILE ...}}
gather the files' summary lines in the order listed, {{reproducers}} their reproducers in page order. Every file is validated against
schema/framework-results.schema.json first. --check writes nothing: it exits 1 with a unified diff when PAGE
differs from what the data gives, 2 on a malformed results file or frame.
"""
import argparse
import difflib
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
SCHEMA = os.path.join(ROOT, "schema", "framework-results.schema.json")
PAGE = os.path.join(ROOT, "docs", "frameworks.md")


class DataError(Exception):
    """A malformed results file or frame: the message names the file and the field."""


# Loading and validation

def _strict_json(path):
    def refuse(constant):
        raise DataError(f"{path}: bare {constant} (write non-finite margins as the strings Infinity, NaN)")
    try:
        with open(path) as f:
            return json.load(f, parse_constant=refuse)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: {e}")


def _schema_errors(schema, data):
    try:
        import jsonschema
    except ImportError:
        raise DataError("python3 cannot import jsonschema: run scripts/install-deps.sh (Debian python3-jsonschema)")
    validator = jsonschema.Draft202012Validator(schema)
    return sorted((_deepest(e) for e in validator.iter_errors(data)), key=lambda e: list(e.absolute_path))


def _deepest(error):
    """Of a oneOf's alternatives, the error that reaches furthest into the data: it names the field at fault."""
    if not error.context:
        return error
    return max((_deepest(e) for e in error.context), key=lambda e: len(e.absolute_path))


def _error_line(path, error):
    message = error.message if len(error.message) <= 200 else error.message[:200] + " ..."
    return f"{path}: /{'/'.join(map(str, error.absolute_path))}: {message}"


def _expected_name(data):
    """A results file's name: the framework's slug and the commit's first 8 characters (or the version)."""
    slug = re.sub(r"[^a-z0-9]+", "-", data["framework"].lower()).strip("-")
    return f"{slug}-{(data.get('commit') or data['version'])[:8]}.json"


def load_results(folder):
    """Every results file of FOLDER, validated: {file name without .json: data}."""
    schema = _strict_json(SCHEMA)
    results = {}
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".json")):
        path = os.path.join(folder, name)
        data = _strict_json(path)
        errors = _schema_errors(schema, data)
        if errors:
            raise DataError("\n".join(_error_line(path, e) for e in errors))
        if name != _expected_name(data):
            raise DataError(f"{path}: /framework, /commit: the file of this framework and commit is {_expected_name(data)}")
        ids = [s["id"] for s in data["sections"]]
        duplicate = next((i for i in ids if ids.count(i) > 1), None)
        if duplicate:
            raise DataError(f"{path}: /sections: id {duplicate!r} twice")
        results[name[:-5]] = data
    if not results:
        raise DataError(f"{folder}: no results files")
    return results


# Rendering

def _margin(value):
    return "inf" if value == "Infinity" else "nan" if value == "NaN" else f"{value:.3g}"


def _case_cell(row):
    sets = ", ".join(f"{k}={v}" for k, v in row.get("overrides", {}).items())
    return row["case"] + (f" ({sets})" if sets else "")


def _detail_cell(row):
    if row["verdict"] == "pass":
        return f"largest margin {_margin(row['largest_margin'])}"
    if row["verdict"] == "error":
        return row["error"]
    detail = ", ".join(f"{check} {_margin(m)}" for check, m in row["failing"].items())
    if isinstance(row.get("attribution"), list):
        detail += "; = " + " + ".join(f"`{entry}`" for entry in row["attribution"])
    return detail


def _results_row(row):
    judged = f"{row['framework']} {row['commit']}"
    verdict = "pass" if row["verdict"] == "pass" else row["verdict"].upper()
    return [judged, f"`{row['function']}`", _case_cell(row), row["layout"], verdict, _detail_cell(row)]


def _table(columns, rows):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _block(block):
    if "results" in block:
        table = block["results"]
        return _table(table["columns"], [_results_row(r) for r in table["rows"]])
    if "table" in block:
        return _table(block["table"]["columns"], block["table"]["rows"])
    return block.get("text", block.get("finding"))


def render_section(section):
    parts = [f"{'#' * section['level']} {section['heading']}"] if section.get("heading") else []
    for block in section["blocks"]:
        text = _block(block)
        if parts and block.get("joined"):
            parts[-1] += "\n" + text
        else:
            parts.append(text)
    return "\n\n".join(parts)


def _summary_table(results, names, group):
    rows = [[line["label"], line["function"] + (", " + line["how"] if line.get("how") else ""), line["verdict"]]
            for name in names for line in results[name]["summary"] if line["group"] == group]
    return _table(["framework, commit", "function", "verdict"], rows)


def _summary_files(arguments, results, number):
    """{{summary GROUP FILE ...}}: the group, and its files in table order; every file with summary lines of
    that group listed exactly once."""
    if not arguments or arguments[0] not in ("training", "rl"):
        raise DataError(f"page.md:{number}: {{{{summary}}}} takes training or rl, then the files in table order")
    group, names = arguments[0], arguments[1:]
    for name in names:
        if name not in results:
            raise DataError(f"page.md:{number}: no results file {name}.json")
    for name, data in results.items():
        if any(line["group"] == group for line in data["summary"]) and names.count(name) != 1:
            raise DataError(f"{name}.json: /summary: its {group} lines are listed {names.count(name)} times on "
                            f"page.md:{number} (once is right)")
    return group, names


def _reproducers_table(results, order):
    rows = [[f"`{r['file']}`", r["shape"], r["run"], r["verdict"]] for name in order
            for r in results[name].get("reproducers", [])]
    return _table(["file", "shape, layout", "framework, function", "verdict on the reproducer"], rows)


PLACEHOLDER = re.compile(r"^\{\{(section|summary|reproducers)\s*([^}]*)\}\}$")


def _placements(frame, results):
    """The (file, section id) of every {{section}} line, in page order; each section placed exactly once."""
    placed = []
    for number, line in enumerate(frame.splitlines(), 1):
        match = PLACEHOLDER.match(line.strip())
        if match and match.group(1) == "section":
            name, _, section_id = match.group(2).strip().partition("#")
            if name not in results or section_id not in [s["id"] for s in results[name]["sections"]]:
                raise DataError(f"page.md:{number}: no section {match.group(2).strip()} in the results files")
            placed.append((name, section_id))
    for name, data in results.items():
        for section in data["sections"]:
            count = placed.count((name, section["id"]))
            if count != 1:
                raise DataError(f"{name}.json: /sections/{section['id']}: placed {count} times in page.md (once is right)")
    return placed


def render_page(frame, results):
    placed = _placements(frame, results)
    order = list(dict.fromkeys(name for name, _ in placed))  # files in the order of their first section
    out = []
    for number, line in enumerate(frame.splitlines(), 1):
        match = PLACEHOLDER.match(line.strip())
        if not match:
            out.append(line)
        elif match.group(1) == "section":
            name, _, section_id = match.group(2).strip().partition("#")
            out.append(render_section(next(s for s in results[name]["sections"] if s["id"] == section_id)))
        elif match.group(1) == "summary":
            group, names = _summary_files(match.group(2).split(), results, number)
            out.append(_summary_table(results, names, group))
        else:
            out.append(_reproducers_table(results, order))
    return "\n".join(out).rstrip("\n") + "\n"


def generate(results_dir):
    frame_path = os.path.join(results_dir, "page.md")
    try:
        with open(frame_path) as f:
            frame = f.read()
    except OSError as e:
        raise DataError(f"{frame_path}: {e}")
    return render_page(frame, load_results(results_dir))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with PAGE instead of writing it")
    parser.add_argument("--page", default=PAGE, help="the page (default docs/frameworks.md)")
    parser.add_argument("--results", default=RESULTS, help="the results folder (default scripts/frameworks/results)")
    args = parser.parse_args(argv)
    try:
        text = generate(args.results)
    except DataError as e:
        print(f"summary.py: {e}", file=sys.stderr)
        return 2
    if not args.check:
        with open(args.page, "w") as f:
            f.write(text)
        return 0
    try:
        with open(args.page) as f:
            on_disk = f.read()
    except OSError as e:
        print(f"summary.py: {args.page}: {e}", file=sys.stderr)
        return 2
    if on_disk == text:
        print(f"{args.page}: agrees with the results data")
        return 0
    sys.stdout.writelines(difflib.unified_diff(on_disk.splitlines(True), text.splitlines(True),
                                               args.page, "generated from the results data"))
    print(f"summary.py: {args.page} differs from the results data: regenerate it with scripts/frameworks/summary.py",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
