#!/usr/bin/env bash
# Every relative link in README.md, RELIABILITY.md and docs/*.md must name a
# file that exists and, with a #fragment, a heading of that file (GitHub's
# anchors: lower case, punctuation dropped, spaces as hyphens).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 - README.md RELIABILITY.md docs/*.md <<'PY'
import os, re, sys

def anchors(path):
    seen, out, fenced = {}, set(), False
    for line in open(path, encoding="utf-8"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out

bad = 0
for path in sys.argv[1:]:
    text, fenced = [], False
    for line in open(path, encoding="utf-8"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            text.append(re.sub(r"`[^`]*`", "", line))
    for target in re.findall(r"\]\(([^)\s]+)\)", "".join(text)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, frag = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            print(f"{path}: {target}: no file {dest}")
            bad += 1
        elif frag and dest.endswith(".md") and frag not in anchors(dest):
            print(f"{path}: {target}: no heading #{frag} in {dest}")
            bad += 1
sys.exit(1 if bad else 0)
PY
