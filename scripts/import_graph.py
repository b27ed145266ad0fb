#!/usr/bin/env python3
"""Import graph of the agent and orchestrator crates (issue 31, item 3).

Reads every `use crate::...`, `use super::...` (and, unless --use-only,
every path `crate::a::b` written inline in code) of crates/agent/src and
crates/orchestrator/src, plus the paths one crate names of the other
(`vmcsnap_orchestrator::...`, `vmcsnap_agent::...`), resolves each to the
file that defines the module, and prints:

  * circles: strongly connected components of files (more than one file);
  * upward imports: a file of the VM layer (one VM's QEMU: qemu.rs,
    qemu_exit.rs, qemu_kept.rs, qemu_find.rs, vm.rs, member.rs, record.rs,
    intent.rs, process.rs, capacity.rs, paths.rs, guest_console.rs, and
    every file that talks QMP through vmcsnap_qmp) importing a file of
    the operations (snapshot, restore, rejuvenate, removal, sampler), of
    the cluster (cluster.rs, cluster_record.rs, cluster_snapshot/, cluster_restore/, the
    orchestrator crate) or of the server (server.rs, dispatch.rs).

Test code is left out (files tests.rs and *_tests.rs, and everything from
a `#[cfg(test)]` module to the end of its file).

  scripts/import_graph.py                   # the report
  scripts/import_graph.py --max-circle 2    # exit 1 if a circle is larger,
                                            # or if any upward import exists
"""

import argparse
import os
import re
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = {
    "agent": ("crates/agent/src", "vmcsnap_agent"),
    "orchestrator": ("crates/orchestrator/src", "vmcsnap_orchestrator"),
}

VM_FILES = {
    "qemu.rs", "qemu_exit.rs", "qemu_kept.rs", "vm.rs", "record.rs",
    "capacity.rs", "paths.rs", "guest_console.rs", "qemu_find.rs", "process.rs",
    "member.rs", "intent.rs",
}
OPERATIONS = ("snapshot", "restore", "rejuvenate", "rejuvenate_cpr",
              "snapshot_removal", "sampler")
CLUSTER = ("cluster", "cluster_record", "cluster_snapshot", "cluster_restore")
SERVER = ("server", "dispatch")


def is_test_file(path):
    base = os.path.basename(path)
    return base == "tests.rs" or base.endswith("_tests.rs")


def strip_code(text):
    """Drops comments, string literals and the test module."""
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    if m:
        text = text[: m.start()]
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'r#*"(?:.|\n)*?"#*', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return text


def module_of(crate_dir, path):
    """The module path (list) a file defines."""
    rel = os.path.relpath(path, crate_dir)[:-3].split(os.sep)
    if rel[-1] in ("lib", "main", "mod"):
        rel = rel[:-1]
    return rel


def expand_use_tree(tree):
    """`a::{b, c::{d as e, f}}` -> ['a::b', 'a::c::d', 'a::c::f']."""
    tree = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", tree.strip())
    out = []

    def walk(prefix, s):
        depth, start, parts = 0, 0, []
        for i, ch in enumerate(s):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(s[start:i])
                start = i + 1
        parts.append(s[start:])
        for p in parts:
            b = p.find("{")
            if b >= 0 and p.endswith("}"):
                head = [x for x in p[:b].split("::") if x]
                walk(prefix + head, p[b + 1 : -1])
            elif p:
                p = re.sub(r"\s+as\s+\w+$", "", p)
                out.append("::".join(prefix + [p]))

    walk([], tree)
    return out


def paths_in(text, use_only):
    """Every path the code names, as lists of segments."""
    found = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        found.extend(expand_use_tree(m.group(1)))
    if not use_only:
        for m in re.finditer(
            r"\b((?:crate|super|vmcsnap_agent|vmcsnap_orchestrator)(?:::\w+)+)", text
        ):
            found.append(m.group(1))
    return [[s for s in p.split("::") if s] for p in found]


class Crate:
    def __init__(self, name, src, extern):
        self.name, self.src, self.extern = name, os.path.join(ROOT, src), extern
        self.files = {}  # module tuple -> relative file name
        for d, _, fs in os.walk(self.src):
            for f in fs:
                if f.endswith(".rs"):
                    p = os.path.join(d, f)
                    if not is_test_file(p):
                        self.files[tuple(module_of(self.src, p))] = p

    def resolve(self, module):
        """The file of the longest module prefix of `module`."""
        for n in range(len(module), -1, -1):
            if tuple(module[:n]) in self.files:
                return self.files[tuple(module[:n])]
        return None


def node(path):
    return os.path.relpath(path, ROOT)


def short(n):
    """crates/agent/src/a/b.rs -> agent:a/b.rs"""
    crate, rel = n.split("/src/", 1)
    return f"{crate.split('/')[-1]}:{rel}"


def build_graph(use_only):
    crates = {k: Crate(k, *v) for k, v in CRATES.items()}
    by_extern = {c.extern: c for c in crates.values()}
    edges = defaultdict(set)
    qmp_users = set()
    for c in crates.values():
        for mod, path in c.files.items():
            text = strip_code(open(path, encoding="utf-8").read())
            if "vmcsnap_qmp" in text:
                qmp_users.add(node(path))
            edges[node(path)]
            for segs in paths_in(text, use_only):
                if not segs:
                    continue
                head = segs[0]
                if head == "crate":
                    target_crate, target = c, segs[1:]
                elif head in ("super", "self"):
                    # a/b.rs and a/b/mod.rs both define module a::b; its
                    # `super` is a, its `self` a::b.
                    base, rest = list(mod), segs
                    while rest and rest[0] in ("super", "self"):
                        base = base[:-1] if rest[0] == "super" else base
                        rest = rest[1:]
                    target_crate, target = c, base + rest
                elif head in by_extern:
                    target_crate, target = by_extern[head], segs[1:]
                else:
                    continue
                f = target_crate.resolve(target)
                if f and f != path:
                    edges[node(path)].add(node(f))
    return edges, qmp_users


def tarjan(edges):
    index, low, on, stack, out, i = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def strong(v):
        index[v] = low[v] = i[0]
        i[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def layer(path, qmp_users):
    rel = path.split("/src/", 1)[1]
    if path.startswith("crates/orchestrator/"):
        return "cluster"
    top = rel.split("/")[0]
    top = top[:-3] if top.endswith(".rs") else top
    if rel in VM_FILES or (path in qmp_users and top not in OPERATIONS + CLUSTER + SERVER):
        return "vm"
    if top in OPERATIONS:
        return "operations"
    if top in CLUSTER:
        return "cluster"
    if top in SERVER:
        return "server"
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--use-only", action="store_true",
                    help="only `use` declarations, not paths written inline")
    ap.add_argument("--max-circle", type=int, default=None,
                    help="exit 1 if a circle has more files, or an upward import exists")
    a = ap.parse_args()
    edges, qmp_users = build_graph(a.use_only)
    comps = [c for c in tarjan(edges) if len(c) > 1]
    comps.sort(key=lambda c: (-len(c), c))
    n_edges = sum(len(v) for v in edges.values())
    print(f"files: {len(edges)}, imports between files: {n_edges}"
          f" ({'use declarations only' if a.use_only else 'use declarations and inline paths'})")
    print(f"circles (strongly connected components of more than one file): {len(comps)}")
    for c in comps:
        print(f"  {len(c)} files: " + ", ".join(short(p) for p in c))
    up = []
    for src in sorted(edges):
        if layer(src, qmp_users) != "vm":
            continue
        for dst in sorted(edges[src]):
            if layer(dst, qmp_users) in ("operations", "cluster", "server"):
                up.append((src, dst, layer(dst, qmp_users)))
    print(f"upward imports from the VM layer: {len(up)}")
    for src, dst, lay in up:
        print(f"  {short(src)} -> {short(dst)} ({lay})")
    if a.max_circle is not None:
        biggest = max((len(c) for c in comps), default=0)
        if biggest > a.max_circle or up:
            print(f"FAIL: largest circle {biggest} files (max {a.max_circle}), "
                  f"{len(up)} upward imports")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
