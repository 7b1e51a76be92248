#!/usr/bin/env python3
"""Checks the links of README.md and the Markdown under docs/ and kernels/: every relative link names
a file of the repository that exists, and every #anchor a heading of its file (GitHub's slugs).
Usage: check_links.py [REPO_ROOT]. Exit 1 with one line per broken link."""
import os
import re
import sys
import unicodedata

root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def strip_code(text):
    """The text without fenced blocks and inline code spans (links there are not links)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path):
    seen, out, fenced = {}, set(), False
    for line in open(path, encoding="utf-8"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


files = [os.path.join(root, "README.md")]
for sub in ("docs", "kernels"):
    for dirpath, _, names in os.walk(os.path.join(root, sub)):
        files += [os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".md")]
broken, checked = [], 0
for f in files:
    text = strip_code(open(f, encoding="utf-8").read())
    for m in list(LINK.finditer(text)) + list(IMAGE.finditer(text)):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        checked += 1
        where = f"{os.path.relpath(f, root)}:{text[:m.start()].count(chr(10)) + 1}"
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
        if not dest.startswith(root + os.sep) and dest != root:
            broken.append(f"{where}: {target} leaves the repository")
            continue
        if not os.path.exists(dest):
            broken.append(f"{where}: {target}: no such file")
            continue
        if anchor and dest.endswith(".md") and anchor not in anchors(dest):
            broken.append(f"{where}: {target}: no heading #{anchor} in {os.path.relpath(dest, root)}")
for b in broken:
    print("broken link:", b)
print(f"{checked} links in {len(files)} files checked, {len(broken)} broken")
sys.exit(1 if broken else 0)
