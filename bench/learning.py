#!/usr/bin/env python3
"""Benchmark: a working set that sees reads, and learning that stays bounded (issue 23).

One 1 GiB lab VM whose memtouch reads 10% of RAM (a 102 MiB buffer, verified in order) and writes
1% (random pages of its first 10 MiB). After the sampler has measured it, one hot snapshot; QEMU
also dumps the VM itself (the anchor for qemu-eager). Then, REPS times, interleaved:
  * qemu-eager: a fresh QEMU, `-incoming defer`, `migrate-incoming exec:cat FILE`, `cont`;
  * lazy and a first workingset restore, each with the snapshot's learned records removed;
  * restores 2..10 of workingset, each learning from the one before (sizes, faults, latency).
Then the cost of tracking: memtouch's verified pages per second on a VM verifying continuously,
in 10 s blocks alternating between no extra clears and QEMU's accessed bits cleared (and the RAM
mapping's smaps read) every second, ten times the sampler's rate.
Goals (issue text): first workingset demand faults in the first 10 s <= 0.3x lazy's; hit rate >= 0.9;
workingset latency <= 0.1x qemu-eager; learned sizes bounded over 10 restores; slowdown <= 2%.

With --redis: the same restores (without qemu-eager and the tracking cost) of the Redis primary of
examples/redis.toml (Debian, q35, 512 MiB, under redisload's writes), restores 1..--chain.

Writes bench/results/learning.json and learning.png (size and faults per restore number), or
learning-redis.json/png.
Usage: bench/learning.py [--reps 3] [--mem 1024] [--redis] [--chain 10] [--out DIR]
Needs: target/release/vmcsnap, root (drops the page cache, reads /proc of QEMU), matplotlib.
"""
import argparse, json, os, re, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
import restore as rb  # noqa: E402  (QEMU's own eager restore, the anchor)

CHAIN = 10
SHOW = [1, 2, 3, 5, 10]


def spec(mem, verify_rate):
    buf, hot = mem // 10, max(1, mem // 100)
    return (f'[cluster]\nname = "bench-ln"\naccel = "auto"\n\n'
            f'[[vm]]\nname = "vm0"\nmemory_mib = {mem}\nworkload = """\n'
            f'memtouch -m {buf} -H {hot} -r 2000 -V {verify_rate} &\n"""\n')


def restore(run_dir, mode, vm="vm0"):
    benchlib.run(rb.VMCSNAP, run_dir, "stop", vm)
    r = benchlib.run(rb.VMCSNAP, run_dir, "restore", "--wait", "s", "--mode", mode, "--json")
    time.sleep(3)  # let the background load finish and the guest settle
    r["faults_first_10s"] = sum(r.get("demand_faults_per_100ms", []))
    return r


def row_of(r, **kw):
    keep = ["restore_latency_ms", "full_load_ms", "ws_pages", "wss", "wss_sample", "wss_snapshot",
            "demand_faults", "faults_first_10s", "quality", "next_wss", "learned", "access_data"]
    return {**{k: r.get(k) for k in keep}, **kw}


def restores(mem, reps, out_rows, redis=False, chain=CHAIN):
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-ln-", dir="/var/tmp")
    work = os.path.join(run_dir, "anchor")
    os.makedirs(work)
    path = os.path.join(run_dir, "spec.toml")
    vm = "primary" if redis else "vm0"
    with open(path, "w") as f:
        f.write(open(os.path.join(rb.ROOT, "examples", "redis.toml")).read() if redis else spec(mem, 3000))
    try:
        up = benchlib.run(rb.VMCSNAP, run_dir, "up", path, "--json")
        time.sleep(rb.SAMPLER_WAIT_S)
        snap = benchlib.run(rb.VMCSNAP, run_dir, "snapshot", vm, "--mode", "hot", "--name", "s", "--json")
        records = os.path.join(run_dir, "snapshots", "s", "restores")
        dump = os.path.join(work, "qemu.mig")
        if not redis:
            pid = up["vms"][0]["pid"]
            cmdline = [c.decode() for c in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:-1]]
            rb.qemu_dump(run_dir, dump)
        for rep in range(reps):
            if not redis:
                benchlib.drop_page_cache()
                r = rb.qemu_eager(cmdline, work, snap["frozen_disk"], dump)
                out_rows.append({"mode": "qemu-eager", "rep": rep, "restore_latency_ms": r["restore_latency_ms"]})
                print(f"  rep {rep} qemu-eager {r['restore_latency_ms']:.0f} ms", file=sys.stderr)
            for mode in ["lazy", "workingset"]:
                shutil.rmtree(records, ignore_errors=True)
                benchlib.drop_page_cache()
                r = restore(run_dir, mode, vm)
                out_rows.append(row_of(r, mode=mode, rep=rep, n=1))
                print(f"  rep {rep} {mode} 1: {r['ws_pages']} first, {r['faults_first_10s']} faults in 10 s, "
                      f"latency {r['restore_latency_ms']:.0f} ms, quality {r.get('quality')}", file=sys.stderr)
            for n in range(2, chain + 1):
                benchlib.drop_page_cache()
                r = restore(run_dir, "workingset", vm)
                out_rows.append(row_of(r, mode="workingset", rep=rep, n=n))
                print(f"  rep {rep} workingset {n}: {r['ws_pages']} first, {r['faults_first_10s']} faults, "
                      f"latency {r['restore_latency_ms']:.0f} ms, next {r.get('next_wss')}", file=sys.stderr)
    finally:
        subprocess.run([rb.VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def ram_file(pid):
    for a in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0"):
        m = re.search(rb"mem-path=([^,]+)", a)
        if m:
            return m.group(1).decode()
    return None


def tracking_cost(blocks):
    """memtouch verified pages/s, 10 s blocks alternating plain / cleared every second."""
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-lt-", dir="/var/tmp")
    path = os.path.join(run_dir, "spec.toml")
    with open(path, "w") as f:
        f.write(spec(256, 0).replace("bench-ln", "bench-lt").replace("memory_mib = 256", "memory_mib = 256"))
    out = []
    try:
        up = benchlib.run(rb.VMCSNAP, run_dir, "up", path, "--json")
        pid = up["vms"][0]["pid"]
        ram = ram_file(pid)
        time.sleep(10)

        def verified():
            con = subprocess.run([rb.VMCSNAP, "--run-dir", run_dir, "console", "vm0"],
                                 capture_output=True, text=True).stdout
            vals = [int(m) for m in re.findall(r"memtouch: .*?verified=(\d+)", con)]
            return vals[-1] if vals else 0

        for b in range(blocks):
            arm = "cleared-1s" if b % 2 else "plain"
            v0, t0 = verified(), time.monotonic()
            while time.monotonic() - t0 < 10:
                if arm == "cleared-1s":
                    with open(f"/proc/{pid}/clear_refs", "w") as f:
                        f.write("1")
                    open(f"/proc/{pid}/smaps").read()
                time.sleep(1)
            v1, t1 = verified(), time.monotonic()
            out.append({"arm": arm, "pages_per_s": (v1 - v0) / (t1 - t0)})
            print(f"  tracking {arm}: {out[-1]['pages_per_s']:.0f} pages/s", file=sys.stderr)
        return out, ram
    finally:
        subprocess.run([rb.VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def summarize(rows, cost):
    med = benchlib.med
    s = {"qemu_eager_latency_ms": med([r["restore_latency_ms"] for r in rows if r["mode"] == "qemu-eager"])}
    if s["qemu_eager_latency_ms"] != s["qemu_eager_latency_ms"]:  # NaN: not measured
        s["qemu_eager_latency_ms"] = None
    for mode in ["lazy", "workingset"]:
        for n in ([1] if mode == "lazy" else range(1, CHAIN + 1)):
            rs = [r for r in rows if r["mode"] == mode and r.get("n") == n]
            if not rs:
                continue
            q = [r["quality"] for r in rs if r.get("quality")]
            s[f"{mode}-{n}"] = {
                "ws_pages": med([r["ws_pages"] for r in rs]),
                "faults_first_10s": med([r["faults_first_10s"] for r in rs]),
                "restore_latency_ms": med([r["restore_latency_ms"] for r in rs]),
                "hit_rate": med([x["hit_rate"] for x in q]) if q else None,
                "accuracy": med([x["accuracy"] for x in q]) if q else None,
            }
    lazy = s.get("lazy-1", {}).get("faults_first_10s")
    ws1 = s.get("workingset-1", {})
    if lazy:
        s["first_workingset_faults_vs_lazy"] = ws1.get("faults_first_10s", 0) / lazy
    if s["qemu_eager_latency_ms"]:
        s["first_workingset_latency_vs_qemu_eager"] = ws1.get("restore_latency_ms", 0) / s["qemu_eager_latency_ms"]
    plain = med([c["pages_per_s"] for c in cost if c["arm"] == "plain"])
    cleared = med([c["pages_per_s"] for c in cost if c["arm"] == "cleared-1s"])
    if cost and plain:
        s["tracking_slowdown_at_1s"] = 1 - cleared / plain
        s["tracking_slowdown_at_sampler_rate_est"] = s["tracking_slowdown_at_1s"] / 10
    return s


def plot(summary, path):
    plt = benchlib.pyplot()
    ns = [n for n in range(1, CHAIN + 1) if f"workingset-{n}" in summary]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(ns, [summary[f"workingset-{n}"]["ws_pages"] for n in ns], "o-", label="pages loaded first")
    a.set_xlabel("restore number (learning from the one before)")
    a.set_ylabel("pages")
    a.set_title("learned working-set size")
    b.plot(ns, [summary[f"workingset-{n}"]["faults_first_10s"] for n in ns], "o-", label="workingset")
    if "lazy-1" in summary:
        b.axhline(summary["lazy-1"]["faults_first_10s"], color="r", ls="--", label="lazy")
    b.set_xlabel("restore number")
    b.set_ylabel("demand faults in the first 10 s (median)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mem", type=int, default=1024)
    ap.add_argument("--cost-blocks", type=int, default=8)
    ap.add_argument("--redis", action="store_true", help="the Redis primary of examples/redis.toml instead")
    ap.add_argument("--chain", type=int, default=CHAIN, help="restores of one snapshot, each learning from the last")
    ap.add_argument("--out", default=os.path.join(rb.ROOT, "bench", "results"))
    a = ap.parse_args()
    rows = []
    restores(a.mem, a.reps, rows, a.redis, a.chain)
    cost = [] if a.redis else tracking_cost(a.cost_blocks)[0]
    summary = summarize(rows, cost)
    os.makedirs(a.out, exist_ok=True)
    name = "learning-redis" if a.redis else "learning"
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump({"memory_mib": 512 if a.redis else a.mem, "reps": a.reps, "summary": summary, "rows": rows,
                   "tracking": cost}, f, indent=1)
    plot(summary, os.path.join(a.out, f"{name}.png"))
    print(json.dumps({k: v for k, v in summary.items() if not k.startswith("workingset-") or
                      int(k.split("-")[1]) in SHOW}, indent=1))


if __name__ == "__main__":
    main()
