"""Helpers shared by the benchmarks in bench/ (not a benchmark itself)."""
import json, statistics, subprocess, sys, time


class Failed(Exception):
    """A vmcsnap command failed; the message holds its stderr."""


def run(vmcsnap, run_dir, *args):
    """Runs `vmcsnap --run-dir RUN_DIR ARGS`; parsed JSON if --json, else stdout. Raises Failed."""
    out = subprocess.run([vmcsnap, "--run-dir", run_dir, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise Failed(f"vmcsnap {' '.join(args)} failed:\n{out.stderr}")
    return json.loads(out.stdout) if "--json" in args else out.stdout


def drop_page_cache():
    """Writes back and drops the host's page cache (root only), so that the next restore reads its
    snapshot from the disk, as a restore after a failure does. Exits with what to do without root."""
    subprocess.run(["sync"])
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        raise SystemExit(f"cannot drop the page cache ({e}): run as root, or keep the cache warm")


def med(xs):
    """Median of the values that are not None; NaN if there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def complete_lines(text):
    """The lines of console text that are complete: a guest's serial port writes a line into its
    console log a byte at a time, so text read while it writes ends in a cut line, whose last number
    may be cut short (retrans=1 of retrans=12)."""
    return text[:text.rfind("\n") + 1].splitlines()


def lost(growth):
    """Segments lost across a restore by one VM, from its `tcp_growth`: the retransmissions no
    duplicate SACK answered (an upper bound: the peer had every other one), or for guests that do
    not report duplicate SACKs, the tail loss probes that repaired a loss."""
    growth = growth or {}
    if growth.get("dsack") is not None:
        return max(0, (growth.get("retrans") or 0) - growth["dsack"])
    return growth.get("tlp_recovered") or 0


def pyplot():
    """matplotlib.pyplot with the Agg backend (pip-installed if missing), or None."""
    try:
        import matplotlib
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"], check=False)
        try:
            import matplotlib
        except ImportError:
            print("matplotlib unavailable; no plot (pip install matplotlib)", file=sys.stderr)
            return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def qemu_load_and_start(q, dump, t0, log_path):
    """QEMU's own eager restore, timed: `q` (a QMP client of a QEMU started
    with -incoming defer at time `t0`) loads `dump` and is resumed. Returns
    request-to-RESUME and request-to-loaded in ms."""
    q.cmd("migrate-incoming", {"uri": f"exec:cat {dump}"})
    while (st := q.cmd("query-migrate").get("status")) != "completed":
        if st in ("failed", "cancelled"):
            raise Failed(f"qemu-eager: {st}: {open(log_path).read()[-500:]}")
        time.sleep(0.005)
    loaded = time.time()
    q.cmd("cont")
    ev = q.wait_event("RESUME")
    ts = ev["timestamp"]["seconds"] + ev["timestamp"]["microseconds"] / 1e6
    q.cmd("quit")
    return {"restore_latency_ms": (ts - t0) * 1000, "full_load_ms": (loaded - t0) * 1000}


def qemu_stop_copy(q, out_file, poll=0.02):
    """QEMU's own stop-copy of a VM into `out_file` through QMP client `q`
    (stop, migrate to the file, cont); returns the guest's pause in ms."""
    t0 = time.time()
    q.cmd("stop")
    q.cmd("migrate", {"uri": f"exec:cat > {out_file}"})
    while q.cmd("query-migrate").get("status") not in ("completed", "failed", "cancelled"):
        time.sleep(poll)
    status = q.cmd("query-migrate")["status"]
    q.cmd("cont")
    if status != "completed":
        raise Failed(f"QEMU dump: {status}")
    return (time.time() - t0) * 1000

