"""Checks a plot written by `lossverify run --plot`: well-formed XML (SVG, or the XHTML-compatible page with
inline SVG), one heatmap cell per rank and quantity, and the expected number of failing gradient cells.

usage: check_plot.py FILE RANKS FAILING_GRAD_CELLS
"""
import sys
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"


def main() -> int:
    path, ranks, failing = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    root = ET.parse(path).getroot()  # raises on malformed markup
    svgs = [root] if root.tag == SVG + "svg" else list(root.iter(SVG + "svg"))
    if not svgs:
        print(f"{path}: no <svg> element (root is {root.tag})")
        return 1
    status = 0
    for svg in svgs:
        rects = list(svg.iter(SVG + "rect"))
        grad = [r for r in rects if r.get("id", "").startswith("grad-cell-r")]
        loss = [r for r in rects if r.get("id", "").startswith("loss-cell-r")]
        failing_grad = [r for r in grad if r.get("class") == "cell fail"]
        bad_margins = [r for r in grad if (float(r.get("data-margin")) > 1) != (r.get("class") == "cell fail")]
        print(f"{path}: {len(grad)} gradient cells, {len(loss)} loss cells, {len(failing_grad)} failing gradient cells")
        if len(grad) != ranks or len(loss) != ranks:
            print(f"{path}: expected {ranks} cells per heatmap")
            status = 1
        if len(failing_grad) != failing:
            print(f"{path}: expected {failing} failing gradient cells")
            status = 1
        if bad_margins:
            print(f"{path}: cell class disagrees with its margin: {[r.get('id') for r in bad_margins]}")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
