#!/usr/bin/env python3
# Every relative link of the Markdown docs (README.md, docs/, plugins/*/README.md) names a file or
# folder that exists. Links inside ``` blocks and to URLs or anchors are not checked.
# Usage: tests/docs/links.py SOURCE_DIR. Exit 1 with one line per broken link.
import glob
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
files = [os.path.join(root, "README.md")]
files += glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True)
files += glob.glob(os.path.join(root, "plugins", "*", "README.md"))
broken = 0
for f in sorted(files):
    with open(f, encoding="utf-8") as fh:
        text = re.sub(r"```.*?```", "", fh.read(), flags=re.S)
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = os.path.normpath(os.path.join(os.path.dirname(f), target.split("#")[0]))
        if not os.path.exists(path):
            print(f"{os.path.relpath(f, root)}: link to {target}: no such file")
            broken += 1
print(f"docs links: {len(files)} files, {broken} broken")
sys.exit(1 if broken else 0)
