# Prints each run's checks of lossverify JSON reports: verdict, margin, element count and worst element (bench/device_run.sh
# compares two oracles' reports of the same case with it).
import json, sys
for path in sys.argv[1:]:
    r = json.load(open(path))
    x = r["runs"][0]
    print(path.split("/")[-1], x["verdict"], x["execution"], "timings", x.get("timings_seconds"))
    for c in x["checks"]:
        w = c.get("worst") or {}
        print("  %-14s %-15s margin %-12.6g compared %s worst %s" % (c["name"], c["verdict"], c["margin"], c.get("metrics", {}).get("compared"), json.dumps(w)[:200]))
