#!/usr/bin/env python3
"""Benchmark: guest asset build time (fresh and cached) and boot-to-ready.

  * `vmcsnap guest build` into an empty cache, then again (cache hit)
  * `vmcsnap up examples/demo.toml` RUNS times (3 VMs booting in parallel):
    boot_ms per VM (QEMU start -> ready marker), median over runs
Writes bench/results/boot.json and prints a table. The fresh build still
uses the Debian kernel package apt already downloaded, if any.

Usage: bench/boot.py [--runs 5] [--spec examples/demo.toml] [--out DIR]
"""
import argparse, json, os, shutil, statistics, subprocess, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.path.join(ROOT, "target", "release", "vmcsnap")


def vm(args, env=None, run_dir=None):
    cmd = [VMCSNAP] + (["--run-dir", run_dir] if run_dir else []) + args
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--spec", default=os.path.join(ROOT, "examples", "demo.toml"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="vmcsnap-cache-")
    env = dict(os.environ, VMCSNAP_CACHE=cache)
    fresh = vm(["guest", "build", "--json"], env)["seconds"]
    cached = vm(["guest", "build", "--json"], env)["seconds"]
    shutil.rmtree(cache)
    boots = {}
    for i in range(a.runs):
        run_dir = tempfile.mkdtemp(prefix="vmcsnap-boot-", dir="/var/tmp")
        up = vm(["up", a.spec, "--json"], run_dir=run_dir)
        subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
        for v in up["vms"]:
            boots.setdefault(v["name"], []).append(v["boot_ms"])
        accel = up["vms"][0]["accel"]
        time.sleep(1)
    all_boots = [b for bs in boots.values() for b in bs]
    result = {
        "bench": "boot", "unix_time": time.time(), "accel": accel, "runs": a.runs, "spec": os.path.relpath(a.spec, ROOT),
        "guest_build_fresh_s": fresh, "guest_build_cached_s": cached,
        "boot_ms": boots, "median_boot_ms": {k: statistics.median(v) for k, v in boots.items()},
        "median_boot_ms_all": statistics.median(all_boots),
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "boot.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"guest assets: fresh build {fresh:.1f} s, cached {cached * 1000:.1f} ms")
    print(f"boot-to-ready ({accel}, {len(boots)} VMs booting in parallel, {a.runs} runs):")
    for k, v in boots.items():
        print(f"  {k:<10} median {statistics.median(v):>6.0f} ms   all {v}")
    print(f"  all VMs    median {result['median_boot_ms_all']:>6.0f} ms")


if __name__ == "__main__":
    main()
