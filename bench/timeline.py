#!/usr/bin/env python3
"""Timeline of a cluster snapshot, like HotSnap's figure 6: one row per VM with its phases
(snapshot start -> pause start, paused, transient snapshot done, full snapshot until the image
is committed), read from the snapshot's cluster.json.

Usage: bench/timeline.py CLUSTER_SNAPSHOT_DIR [-o PNG] [--zoom]
  -o PNG   where to write (default: CLUSTER_SNAPSHOT_DIR/timeline.png)
  --zoom   only the first 1.5x of the last pause end (the pauses, not the background copy)
Prints the PNG's path. Needs matplotlib (pip-installed if missing).
"""
import argparse, json, os, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402


def load(d):
    with open(os.path.join(d, "cluster.json")) as f:
        return json.load(f)


def draw(ax, m, zoom=False):
    vms = m["vms"]
    t0 = min(v["timeline"]["start_us"] for v in vms)
    ms = lambda us: (us - t0) / 1000.0  # noqa: E731
    last_pause_end = max(ms(v["timeline"]["pause_end_us"]) for v in vms)
    for i, v in enumerate(vms):
        t = v["timeline"]
        phases = [
            (ms(t["start_us"]), ms(t["pause_start_us"]), "#9ecae1", "start -> pause"),
            (ms(t["pause_start_us"]), ms(t["pause_end_us"]), "#de2d26", "paused"),
            (ms(t["pause_end_us"]), ms(t["transient_done_us"]), "#fdae6b", "port released"),
            (ms(t["transient_done_us"]), ms(t["complete_us"]), "#a1d99b", "full snapshot (VM runs)"),
        ]
        for a, b, color, label in phases:
            ax.barh(i, max(b - a, 0.01), left=a, color=color, edgecolor="none", label=label if i == 0 else None)
    ax.set_yticks(range(len(vms)))
    ax.set_yticklabels([v["name"] for v in vms])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the cluster snapshot request")
    if zoom:
        ax.set_xlim(0, last_pause_end * 1.5 + 1)
    b = m.get("metrics", {}).get("backoff", {})
    ax.set_title(f'{m["name"]} ({m["mode"]}, {len(vms)} VMs): backoff avg {b.get("avg_ms", float("nan")):.1f} ms, '
                 f'max {b.get("max_ms", float("nan")):.1f} ms', fontsize=9)
    ax.legend(fontsize=7, loc="lower right")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("-o", "--out")
    ap.add_argument("--zoom", action="store_true")
    a = ap.parse_args()
    m = load(a.dir)
    plt = benchlib.pyplot()
    if plt is None:
        return 1
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.2 + 0.45 * len(m["vms"])))
    draw(axes[0], m)
    draw(axes[1], m, zoom=True)
    axes[1].set_title("the pauses (zoomed)", fontsize=9)
    fig.tight_layout()
    out = a.out or os.path.join(a.dir, "timeline.png")
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
