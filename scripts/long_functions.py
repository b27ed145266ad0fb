#!/usr/bin/env python3
"""Functions longer than a limit in the agent and orchestrator crates
(issue 31: none over 150 lines).

Counts each `fn` from its line to the line of its closing brace (comments
and string literals skipped when matching braces); test code is left out
(files tests.rs and *_tests.rs, and `#[cfg(test)]` modules).

  scripts/long_functions.py              # functions over 150 lines, longest first
  scripts/long_functions.py --max 100    # another limit
  scripts/long_functions.py --check      # exit 1 if any
"""

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRS = ["crates/agent/src", "crates/orchestrator/src"]
FN = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+|async\s+|unsafe\s+|extern\s+\"C\"\s+)*fn\s+(\w+)")


def blank_out(text):
    """Comments, strings and char literals replaced by spaces (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = '"' + hashes
            j = text.find(end, i + len(hashes) + 2)
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or (c == "'" and re.match(r"'\\u\{[0-9a-fA-F]+\}'", text[i:i + 12])):
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:])
            out.append(" " * len(m.group(0)))
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(path):
    text = blank_out(open(path, encoding="utf-8").read())
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    if m:
        text = text[: m.start()]
    lines = text.split("\n")
    for no, line in enumerate(lines):
        f = FN.match(line)
        if not f:
            continue
        depth, started = 0, False
        for end in range(no, len(lines)):
            for ch in lines[end]:
                if ch == "{":
                    depth, started = depth + 1, True
                elif ch == "}":
                    depth -= 1
                elif ch == ";" and not started and depth == 0:
                    break  # a declaration without a body
            else:
                if started and depth == 0:
                    yield f.group(1), no + 1, end - no + 1
                    break
                continue
            break


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max", type=int, default=150)
    ap.add_argument("--check", action="store_true", help="exit 1 if any function is longer")
    a = ap.parse_args()
    found = []
    for d in DIRS:
        for dp, _, fs in os.walk(os.path.join(ROOT, d)):
            for f in fs:
                if not f.endswith(".rs") or f == "tests.rs" or f.endswith("_tests.rs"):
                    continue
                p = os.path.join(dp, f)
                for name, line, n in functions(p):
                    if n > a.max:
                        found.append((n, os.path.relpath(p, ROOT), line, name))
    found.sort(key=lambda x: (-x[0], x[1]))
    print(f"functions over {a.max} lines: {len(found)}")
    for n, p, line, name in found:
        print(f"  {n:4d}  {p}:{line}  {name}")
    return 1 if a.check and found else 0


if __name__ == "__main__":
    sys.exit(main())
