#!/usr/bin/env python3
"""A lossverify report without what legitimately varies from run to run (timings, resources, dates, host names, the
binary's identity, file paths' folders), so that two reports of one answer compare equal.

    report_normalise.py FILE...   rewrites each report in place: numbers keep their exact text (no float
                                  re-formatting), keys sorted, 2-space indentation, so two normalised reports are
                                  byte-identical exactly when their kept contents are (scripts/report_parity.sh).
    import report_normalise; report_normalise.scrub(run)   the same rules on a parsed object (tests/cli/replay_parity.py).
"""
import json
import os
import re
import sys

# Keys removed wherever they appear (any depth).
DROP_ANYWHERE = {
    # timings and durations
    "timings", "timings_seconds", "wall", "wall_seconds", "seconds", "load_seconds",
    "duration", "duration_seconds", "elapsed", "elapsed_seconds",
    # resources
    "resources", "peak_rss_bytes", "peak_rss_bytes_per_rank",
    # dates / timestamps
    "timestamp", "date", "time", "started", "started_at", "finished", "finished_at", "created",
    # host names
    "host", "hostname", "host_name", "node",
}
# Keys removed only inside a given top-level object.
DROP_IN = {
    # identity of the binary: its version, git revision and how it was built
    "tool": {"version", "git_revision", "commit", "build_id"},
    # the build and the host the binary ran on
    "environment": {"compiler", "build_type", "hardware_threads", "hostname", "host"},
}
# Keys whose value is a filesystem path: reduced to the file's base name.
BASENAME = {"case_file", "manifest"}
KEEP = {"timeout_seconds"}  # a case input, not a measurement


def is_time_key(k):
    if k in KEEP:
        return False
    return k in DROP_ANYWHERE or k.endswith("_seconds") or k.endswith("_ms") or k.endswith("_ns")


def scrub(o):
    """o without the keys above, at any depth (a whole report, or one of its runs)."""
    if isinstance(o, dict):
        out = {}
        for k, v in o.items():
            if is_time_key(k):
                continue
            if k in BASENAME and isinstance(v, str):
                v = os.path.basename(v)
            out[k] = scrub(v)
        return out
    if isinstance(o, list):
        return [scrub(x) for x in o]
    return o


def normalise_document(doc):
    """A whole report: its top-level tool and environment fields (DROP_IN) too."""
    if isinstance(doc, dict):
        for top, keys in DROP_IN.items():
            if isinstance(doc.get(top), dict):
                for k in keys:
                    doc[top].pop(k, None)
    return scrub(doc)


MARK = "\u0001F"
RAW_FLOAT = re.compile(r'"\\u0001F([^"\\]*)\\u0001"')


def normalise_file(path):
    with open(path, encoding="utf-8") as f:
        # keep every float's exact text: carried through as a marked string, put back raw below
        doc = json.load(f, parse_float=lambda s: MARK + s + "\u0001")
    text = json.dumps(normalise_document(doc), indent=2, sort_keys=True, ensure_ascii=True)
    text = RAW_FLOAT.sub(lambda m: m.group(1), text) + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        normalise_file(path)
