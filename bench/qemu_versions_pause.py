#!/usr/bin/env python3
"""Benchmark: the hot snapshot's pause on QEMU 7.2 vs QEMU 10.0 (issue 30), side by side.

Two clusters in one run, one per QEMU version (7.2: the system's or $VMCSNAP_QEMU as found;
10.0: scripts/install-qemu.sh 10.0), each with one lab guest (--mib, default 256 MiB, memtouch
over 32 MiB). REPS times, interleaved (7.2 then 10.0 in each rep, so load hits both alike):
  * `vmcsnap pause-limit VM`: that QEMU's own background snapshot (the floor);
  * `vmcsnap snapshot VM --mode hot --full`: vmcsnap's hot pause with its parts; deleted after.
Prints per version the medians of the hot pause, the floor, their ratio and the parts; writes
bench/results/qemu_versions_pause.json.

Usage: bench/qemu_versions_pause.py [--reps 3] [--mib 256] [--bin PATH]
"""
import argparse, json, os, shutil, subprocess, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def qemu10():
    out = subprocess.run([os.path.join(ROOT, "scripts", "install-qemu.sh"), "10.0"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def vmcsnap(binary, run_dir, qemu, *args):
    env = dict(os.environ)
    if qemu:
        env["VMCSNAP_QEMU"] = qemu
    else:
        env.pop("VMCSNAP_QEMU", None)
    out = subprocess.run([binary, "--run-dir", run_dir, *args], capture_output=True, text=True,
                         env=env)
    if out.returncode != 0:
        raise benchlib.Failed(f"vmcsnap {' '.join(args)} failed:\n{out.stderr}")
    return json.loads(out.stdout) if "--json" in args else out.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "vmcsnap"))
    a = ap.parse_args()
    versions = [("7.2", None), ("10.0", qemu10())]
    dirs = {}
    rows = []
    try:
        for v, q in versions:
            d = tempfile.mkdtemp(prefix=f"vmcsnap-bench-q{v}-", dir="/var/tmp")
            dirs[v] = d
            spec = os.path.join(d, "spec.toml")
            with open(spec, "w") as f:
                f.write(f'[cluster]\nname = "qv{v.replace(".", "")}"\naccel = "auto"\n\n[[vm]]\n'
                        f'name = "lab"\nmemory_mib = {a.mib}\nworkload = """\nmemtouch -m 32 &\n"""\n')
            vmcsnap(a.bin, d, q, "up", spec, "--json")
        for rep in range(a.reps):
            for v, q in versions:
                d = dirs[v]
                lim = vmcsnap(a.bin, d, q, "pause-limit", "lab", "--json")
                name = f"qv-{rep}"
                r = vmcsnap(a.bin, d, q, "snapshot", "lab", "--mode", "hot", "--full", "--name",
                            name, "--json")
                vmcsnap(a.bin, d, q, "snapshots", "delete", name)
                parts = {p["name"]: p["us"] / 1000 for p in (r.get("pause") or {}).get("parts", [])}
                rows.append({"qemu": v, "rep": rep, "hot_ms": r["downtime_ms"],
                             "floor_ms": lim["downtime_ms"], "parts": parts})
                print(f"QEMU {v:<4} rep {rep}: hot {r['downtime_ms']:.1f} ms (floor "
                      f"{lim['downtime_ms']:.1f}) = "
                      + " + ".join(f"{k} {x:.1f}" for k, x in parts.items()), file=sys.stderr)
    finally:
        for v, q in versions:
            if v in dirs:
                try:
                    vmcsnap(a.bin, dirs[v], q, "down")
                except benchlib.Failed as e:
                    print(e, file=sys.stderr)
                shutil.rmtree(dirs[v], ignore_errors=True)
    summary = {}
    print(f"\n{a.mib} MiB lab guest, medians of {a.reps} interleaved runs")
    print(f"{'QEMU':<6} {'hot ms':>8} {'floor ms':>9} {'hot/floor':>9}  parts")
    for v, _ in versions:
        rs = [r for r in rows if r["qemu"] == v]
        hot = benchlib.med([r["hot_ms"] for r in rs])
        floor = benchlib.med([r["floor_ms"] for r in rs])
        names = list(dict.fromkeys(k for r in rs for k in r["parts"]))
        parts = {k: benchlib.med([r["parts"].get(k) for r in rs]) for k in names}
        summary[v] = {"hot_ms": hot, "floor_ms": floor, "parts_ms": parts}
        print(f"{v:<6} {hot:>8.1f} {floor:>9.1f} {hot / floor:>9.2f}  "
              + ", ".join(f"{k} {x:.1f}" for k, x in parts.items()))
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "qemu_versions_pause.json"), "w") as f:
        json.dump({"mib": a.mib, "reps": a.reps, "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
