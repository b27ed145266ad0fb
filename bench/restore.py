#!/usr/bin/env python3
"""Benchmark: restore latency and demand paging, QEMU's own eager restore vs vmcsnap's modes
(issue: fast restore, HotRestore).

Side by side in one run, on real QEMU guests booted by vmcsnap. Per guest size (default 256 MiB,
1 GiB, 2 GiB), a cluster of two VMs: vm0 runs memtouch over ~7% of its RAM (its working set) and a
KV server, vm1 drives a KV load against it. After the sampler has measured WSS_sample, one hot
snapshot of vm0 is taken, and QEMU itself also dumps vm0 (stop, `migrate exec:cat > FILE`, cont,
through the agent's second QMP socket): the anchor.
Then, REPS times, interleaved:
  * qemu-eager: a fresh QEMU with vm0's command line, `-incoming defer`, `migrate-incoming
    exec:cat FILE`, `cont`: QEMU start → RESUME;
  * vmcsnap restore --mode eager | lazy | sampling-ws | workingset (restore latency, pages and
    bytes before start, demand faults and their per-100 ms counts for 10 s, full load);
  * workingset a second time, learning from the first (restore 2 vs restore 1);
  * at the middle size only: workingset at 0.5x, 0.7x, 1x and 2x the hybrid WSS before halving
    (HotRestore §6.1.3; 0.5x is what `--wss auto` loads).
The page cache is dropped before every restore (as root) so that reads come from the disk, as in
the paper; `--warm-cache` keeps it. Learned records are removed before every restore except the
"restore 2" one, so each mode sees the snapshot alone.
Goals (issue text): workingset latency <= 0.1x qemu-eager; workingset demand faults in the first
10 s <= 0.3x lazy's; vmcsnap eager <= qemu-eager; workingset full load <= 1.2x qemu-eager latency.
Writes bench/results/restore.json, restore.png (latency by mode and size) and
restore-faults.png (demand faults per 100 ms by WSS factor), and prints tables.

Usage: bench/restore.py [--reps 3] [--sizes 256,1024,2048] [--out DIR] [--warm-cache]
Needs: target/release/vmcsnap (make build), root (to drop the page cache), matplotlib (pip-installed if missing).
"""
import argparse, json, os, shutil, socket, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.path.join(ROOT, "target", "release", "vmcsnap")
MODES = ["qemu-eager", "eager", "lazy", "sampling-ws", "workingset", "workingset-2"]
FACTORS = [0.5, 0.7, 1.0, 2.0]
SAMPLER_WAIT_S = 25  # the agent samples every 10 s; wait for two samples


def run(run_dir, *args):
    return benchlib.run(VMCSNAP, run_dir, *args)


def spec(mem):
    ws = max(8, mem * 7 // 100)
    return (f'[cluster]\nname = "bench-rs"\naccel = "auto"\n\n'
            f'[[vm]]\nname = "vm0"\nmemory_mib = {mem}\nworkload = """\n'
            f'memtouch -m {ws} -r 2000 &\nkvserver 7001 &\n"""\n\n'
            f'[[vm]]\nname = "vm1"\nmemory_mib = 160\nworkload = """\nkvload {{ip:vm0}} 7001 &\n"""\n')


class Qmp:
    """A minimal QMP client (events are queued while waiting for replies)."""

    def __init__(self, path, timeout=120):
        deadline = time.monotonic() + 20
        while True:
            try:
                self.s = socket.socket(socket.AF_UNIX)
                self.s.connect(path)
                break
            except OSError:
                self.s.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.s.settimeout(timeout)
        self.f = self.s.makefile("rw")
        self.events = []
        self.f.readline()
        self.cmd("qmp_capabilities")

    def _read(self):
        line = self.f.readline()
        if not line:
            raise benchlib.Failed("QMP connection closed")
        return json.loads(line)

    def cmd(self, name, args=None):
        self.f.write(json.dumps({"execute": name, **({"arguments": args} if args else {})}) + "\n")
        self.f.flush()
        while True:
            m = self._read()
            if "event" in m:
                self.events.append(m)
            elif "error" in m:
                raise benchlib.Failed(f"QMP {name}: {m['error']}")
            elif "return" in m:
                return m["return"]

    def wait_event(self, name):
        while True:
            for e in self.events:
                if e["event"] == name:
                    self.events.remove(e)
                    return e
            self.events.append(self._read())

    def close(self):
        self.s.close()


def qemu_dump(run_dir, out_file):
    """QEMU's own snapshot of vm0 (stop-copy into a file), through the sampler's QMP socket."""
    q = Qmp(os.path.join(run_dir, "cluster", "vm0", "sample.sock"))
    try:
        benchlib.qemu_stop_copy(q, out_file, poll=0.05)
    finally:
        q.close()


def anchor_args(cmdline, work, frozen_disk):
    """vm0's QEMU command line, rewritten for a throwaway eager-restore destination."""
    overlay = os.path.join(work, "anchor.qcow2")
    if os.path.exists(overlay):
        os.remove(overlay)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", frozen_disk, overlay], check=True)
    args, qmp_done, skip = [], False, False
    for i, a in enumerate(cmdline):
        if skip:
            skip = False
            continue
        if a == "-qmp":
            skip = True
            if not qmp_done:
                args += ["-qmp", f"unix:{work}/anchor-qmp.sock,server=on,wait=off"]
                qmp_done = True
            continue
        if a.startswith("memory-backend-file,"):
            a = ",".join("mem-path=/dev/shm/vmcsnap-bench-anchor" if p.startswith("mem-path=") else p for p in a.split(","))
        elif a.startswith("file,id=con,"):
            a = f"file,id=con,path={work}/anchor-console.log"
        elif a.startswith("driver=qcow2,"):
            a = ",".join(f"file.filename={overlay}" if p.startswith("file.filename=") else p for p in a.split(","))
        elif a.startswith("stream,"):
            a = ",".join(f"addr.path={work}/anchor-net.sock" if p.startswith("addr.path=") else p for p in a.split(","))
        args.append(a)
    return args + ["-incoming", "defer"]


def net_sink(path):
    """Accepts the anchor NIC's connection and discards its frames."""
    if os.path.exists(path):
        os.remove(path)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(4)

    def loop():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=lambda: [None for _ in iter(lambda: c.recv(65536), b"")], daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()
    return srv


def qemu_eager(cmdline, work, frozen_disk, dump):
    args = anchor_args(cmdline, work, frozen_disk)
    sink = net_sink(f"{work}/anchor-net.sock")
    qmp_path = f"{work}/anchor-qmp.sock"
    if os.path.exists(qmp_path):
        os.remove(qmp_path)
    t0 = time.time()
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(f"{work}/anchor-qemu.log", "w"))
    try:
        q = Qmp(qmp_path)
        return benchlib.qemu_load_and_start(q, dump, t0, f"{work}/anchor-qemu.log")
    finally:
        p.kill()
        p.wait()
        sink.close()
        for f in ("/dev/shm/vmcsnap-bench-anchor",):
            if os.path.exists(f):
                os.remove(f)


def vmcsnap_restore(run_dir, snap, mode, wss=None):
    run(run_dir, "stop", "vm0")
    args = ["restore", "--wait", snap, "--mode", mode, "--json"]
    if wss is not None:
        args += ["--wss", str(wss)]
    r = run(run_dir, *args)
    time.sleep(3)  # let the background load finish and the guest settle
    return r


def measure_size(mem, reps, cold, middle):
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-rs-", dir="/var/tmp")
    work = os.path.join(run_dir, "anchor")
    os.makedirs(work)
    path = os.path.join(run_dir, "spec.toml")
    with open(path, "w") as f:
        f.write(spec(mem))
    print(f"== {mem} MiB", file=sys.stderr)
    rows = []
    try:
        up = run(run_dir, "up", path, "--json")
        accel = up["vms"][0]["accel"]
        time.sleep(SAMPLER_WAIT_S)
        snap = run(run_dir, "snapshot", "vm0", "--mode", "hot", "--name", "s", "--json")
        records = os.path.join(run_dir, "snapshots", "s", "restores")
        pid = up["vms"][0]["pid"]
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:-1]
        cmdline = [c.decode() for c in cmdline]
        dump = os.path.join(work, "qemu.mig")
        qemu_dump(run_dir, dump)
        base = None
        for i in range(reps):
            plan = [(m, None) for m in MODES] + ([(f"workingset-x{f}", f) for f in FACTORS] if middle else [])
            for mode, factor in plan:
                if mode != "workingset-2":
                    shutil.rmtree(records, ignore_errors=True)
                if cold:
                    benchlib.drop_page_cache()
                try:
                    if mode == "qemu-eager":
                        r = qemu_eager(cmdline, work, snap["frozen_disk"], dump)
                    elif factor is not None and base is None:
                        continue  # the auto-sized workingset restore failed: no base size
                    elif factor is not None:
                        r = vmcsnap_restore(run_dir, "s", "workingset", max(1, round(base * factor)))
                    else:
                        r = vmcsnap_restore(run_dir, "s", mode.replace("-2", ""))
                except benchlib.Failed as e:
                    err = str(e).strip().splitlines()[-1]
                    rows.append({"memory_mib": mem, "accel": accel, "mode": mode, "rep": i, "error": err})
                    print(f"   {mode:<16} rep {i}: FAILED: {err}", file=sys.stderr)
                    continue
                if mode == "workingset" and base is None:
                    base = 2 * r["wss"]  # the hybrid size before HotRestore's halving
                row = {**r, "memory_mib": mem, "accel": accel, "mode": mode, "rep": i, "factor": factor}
                row["faults_first_10s"] = sum(r.get("demand_faults_per_100ms", []))
                rows.append(row)
                print(f"   {mode:<16} rep {i}: latency {r['restore_latency_ms']:8.1f} ms, full load "
                      f"{r['full_load_ms']:8.0f} ms" + (f", {r['ws_pages']} pages first, {r['demand_faults']} faults"
                                                       if "ws_pages" in r else ""), file=sys.stderr)
        return rows, base
    finally:
        subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def summarize(rows, sizes):
    out = {}
    for mem in sizes:
        s = {}
        for mode in sorted({r["mode"] for r in rows if r["memory_mib"] == mem}):
            rs = [r for r in rows if r["memory_mib"] == mem and r["mode"] == mode and "error" not in r]
            s[mode] = {k: benchlib.med([r.get(k) for r in rs]) for k in
                       ["restore_latency_ms", "full_load_ms", "ws_pages", "bytes_read_before_start",
                        "demand_faults", "faults_first_10s"]}
            s[mode]["ok"] = f"{len(rs)}/{len([r for r in rows if r['memory_mib'] == mem and r['mode'] == mode])}"
            if rs and "demand_faults_per_100ms" in rs[0]:
                n = len(rs[0]["demand_faults_per_100ms"])
                s[mode]["faults_per_100ms"] = [benchlib.med([r["demand_faults_per_100ms"][i] for r in rs]) for i in range(n)]
        q, w, lz = s.get("qemu-eager", {}), s.get("workingset", {}), s.get("lazy", {})
        g = {}
        if q and w:
            g["workingset_latency_le_0.1x_qemu"] = w["restore_latency_ms"] <= 0.1 * q["restore_latency_ms"]
            g["workingset_full_load_le_1.2x_qemu_latency"] = w["full_load_ms"] <= 1.2 * q["restore_latency_ms"]
        if q and "eager" in s:
            g["eager_le_qemu"] = s["eager"]["restore_latency_ms"] <= q["restore_latency_ms"]
        if w and lz:
            g["workingset_faults_10s_le_0.3x_lazy"] = w["faults_first_10s"] <= 0.3 * lz["faults_first_10s"]
        s["goals"] = g
        out[str(mem)] = s
    return out


def print_tables(summary):
    print("median per (memory, mode); latency = request -> guest running; faults = demand faults (first 10 s)")
    print(f"{'memory':<8}{'mode':<18}{'latency ms':>11}{'vs qemu':>9}{'full load ms':>13}{'pages first':>12}"
          f"{'MiB first':>10}{'faults':>8}{'10 s':>7}{'ok':>6}")
    for mem, s in summary.items():
        q = s.get("qemu-eager", {}).get("restore_latency_ms")
        for mode, v in s.items():
            if mode == "goals":
                continue
            ratio = v["restore_latency_ms"] / q if q else float("nan")
            mib = (v["bytes_read_before_start"] or 0) / 1048576 if v["bytes_read_before_start"] == v["bytes_read_before_start"] else float("nan")
            print(f"{mem + 'MiB':<8}{mode:<18}{v['restore_latency_ms']:>11.1f}{ratio:>9.3f}{v['full_load_ms']:>13.0f}"
                  f"{v['ws_pages']:>12.0f}{mib:>10.1f}{v['demand_faults']:>8.0f}{v['faults_first_10s']:>7.0f}{v['ok']:>6}")
        goals = "  ".join(k + "=" + ("yes" if ok else "NO") for k, ok in s["goals"].items())
        print(f"  goals: {goals}")


def plot(summary, path_latency, path_faults):
    plt = benchlib.pyplot()
    if plt is None:
        return
    sizes = list(summary)
    modes = ["qemu-eager", "eager", "lazy", "sampling-ws", "workingset", "workingset-2"]
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        ys = [summary[m].get(mode, {}).get("restore_latency_ms", float("nan")) for m in sizes]
        ax.bar([i + j * w for i in range(len(sizes))], ys, w, label=mode)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(sizes))])
    ax.set_xticklabels([f"{m} MiB" for m in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("restore latency, ms (median, log)")
    ax.set_title("Restore latency: QEMU eager vs vmcsnap modes (TCG)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path_latency, dpi=120)
    fig, ax = plt.subplots(figsize=(7, 4))
    for mem, s in summary.items():
        for mode, v in s.items():
            if mode.startswith("workingset-x") and v.get("faults_per_100ms"):
                ys = v["faults_per_100ms"]
                ax.plot([i * 0.1 for i in range(len(ys))], ys, label=f"{mode[len('workingset-x'):]} x WSS ({v['ws_pages']:.0f} pages)")
    ax.set_xlabel("seconds after the guest starts")
    ax.set_ylabel("demand faults per 100 ms (median)")
    ax.set_title("Demand faults vs working-set size (HotRestore fig. 6)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_faults, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="256,1024,2048")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--warm-cache", action="store_true", help="do not drop the page cache before each restore")
    a = ap.parse_args()
    if not os.path.exists(VMCSNAP):
        raise SystemExit(f"{VMCSNAP} missing: run `make build` first")
    sizes = [int(x) for x in a.sizes.split(",")]
    middle = sizes[len(sizes) // 2]
    rows, bases = [], {}
    for mem in sizes:
        r, base = measure_size(mem, a.reps, not a.warm_cache, mem == middle)
        rows += r
        bases[mem] = base
    summary = summarize(rows, sizes)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "restore.json"), "w") as f:
        json.dump({"bench": "restore", "unix_time": time.time(), "reps": a.reps, "cold_cache": not a.warm_cache,
                   "wss_base_pages": bases, "summary": summary, "rows": rows}, f, indent=1)
    print_tables(summary)
    plot(summary, os.path.join(a.out, "restore.png"), os.path.join(a.out, "restore-faults.png"))
    print(f"wrote {a.out}/restore.json, restore.png, restore-faults.png")


if __name__ == "__main__":
    main()
