//! Metrics that operators scrape: the agent records the figures its
//! operations already measure (their reports) as per-VM histograms and
//! counters, and serves them in the Prometheus/OpenMetrics text format
//! (`prometheus-client`) on an opt-in address
//! (`vmcsnap agent run --metrics-listen ADDR`, or `VMCSNAP_METRICS_LISTEN`
//! for an agent the CLI starts on demand).
//!
//! The operations know nothing of this module: they return their reports,
//! and the request dispatch hands each report to a `record_*` function here.
//! Where each figure comes from:
//!
//! | metric | labels | from |
//! |---|---|---|
//! | `vmcsnap_snapshot_pause_seconds` (histogram) | `vm` | `snapshot::Report::downtime_ms`, `cluster_snapshot::VmReport::downtime_ms` (QMP STOP to RESUME) |
//! | `vmcsnap_snapshot_bytes_total` (counter) | `vm` | `pages_stored` × 4096 of the same reports: bytes of the pages the image holds |
//! | `vmcsnap_backoff_seconds` (histogram) | `vm`, `operation` | cluster snapshot: the largest `PairBackoff::backoff_ms` of the VM's pairs; cluster restore: `VmRestoreReport::backoff_ms` |
//! | `vmcsnap_restore_latency_seconds` (histogram) | `vm` | `restore::Report::restore_latency_ms`, `VmRestoreReport::latency_ms` (request to guest running) |
//! | `vmcsnap_demand_faults_total` (counter) | `vm` | `restore::Report::demand_faults`, `VmRestoreReport::demand_faults` (as counted when the report was made) |
//! | `vmcsnap_rejuvenation_downtime_seconds` (histogram) | `vm` | `rejuvenate::Report::downtime_ms` |

use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A guest page, for the bytes of the pages an image stores.
const PAGE_BYTES: u64 = 4096;

/// Labels of a per-VM metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Vm {
    vm: String,
}

/// Labels of a per-VM metric that several operations feed.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VmOp {
    vm: String,
    operation: String,
}

type Seconds<L> = Family<L, Histogram, fn() -> Histogram>;

/// 1 ms to about 33 s, doubling.
fn seconds() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// The agent's metrics.
struct Metrics {
    registry: Registry,
    pause: Seconds<Vm>,
    snapshot_bytes: Family<Vm, Counter>,
    backoff: Seconds<VmOp>,
    restore_latency: Seconds<Vm>,
    demand_faults: Family<Vm, Counter>,
    rejuvenation: Seconds<Vm>,
}

impl Metrics {
    fn new() -> Metrics {
        let mut registry = Registry::default();
        let pause = Seconds::<Vm>::new_with_constructor(seconds);
        let snapshot_bytes = Family::<Vm, Counter>::default();
        let backoff = Seconds::<VmOp>::new_with_constructor(seconds);
        let restore_latency = Seconds::<Vm>::new_with_constructor(seconds);
        let demand_faults = Family::<Vm, Counter>::default();
        let rejuvenation = Seconds::<Vm>::new_with_constructor(seconds);
        let r = &mut registry;
        r.register(
            "vmcsnap_snapshot_pause_seconds",
            "Guest paused by a snapshot (QMP STOP to RESUME)",
            pause.clone(),
        );
        r.register(
            "vmcsnap_snapshot_bytes",
            "Bytes of the pages stored in snapshot images",
            snapshot_bytes.clone(),
        );
        r.register(
            "vmcsnap_backoff_seconds",
            "TCP backoff of a VM's peers during a cluster snapshot or after a cluster restore",
            backoff.clone(),
        );
        r.register(
            "vmcsnap_restore_latency_seconds",
            "Restore request to guest running",
            restore_latency.clone(),
        );
        r.register(
            "vmcsnap_demand_faults",
            "Pages a restored guest faulted on before they were loaded",
            demand_faults.clone(),
        );
        r.register(
            "vmcsnap_rejuvenation_downtime_seconds",
            "Guest not running during a rejuvenation (QEMU restart)",
            rejuvenation.clone(),
        );
        Metrics {
            registry,
            pause,
            snapshot_bytes,
            backoff,
            restore_latency,
            demand_faults,
            rejuvenation,
        }
    }

    fn snapshot(&self, vm: &str, pause_ms: f64, pages_stored: u64) {
        let l = Vm { vm: vm.into() };
        self.pause.get_or_create(&l).observe(pause_ms / 1000.0);
        let bytes = pages_stored.saturating_mul(PAGE_BYTES);
        self.snapshot_bytes.get_or_create(&l).inc_by(bytes);
    }

    fn restore(&self, vm: &str, latency_ms: f64, demand_faults: u64) {
        let l = Vm { vm: vm.into() };
        (self.restore_latency.get_or_create(&l)).observe(latency_ms / 1000.0);
        self.demand_faults.get_or_create(&l).inc_by(demand_faults);
    }

    fn backoff(&self, vm: &str, operation: &str, ms: f64) {
        let l = VmOp {
            vm: vm.into(),
            operation: operation.into(),
        };
        self.backoff.get_or_create(&l).observe(ms / 1000.0);
    }
}

fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(Metrics::new)
}

/// Records a snapshot of one VM.
pub fn record_snapshot(r: &crate::snapshot::Report) {
    metrics().snapshot(&r.vm, r.downtime_ms, r.pages_stored);
}

/// Records a cluster snapshot: each VM's pause and image, and each VM's
/// backoff (the largest of the pairs it is in).
pub fn record_cluster_snapshot(r: &crate::cluster_snapshot::ClusterReport) {
    let m = metrics();
    for v in &r.vms {
        m.snapshot(&v.vm, v.downtime_ms, v.pages_stored);
        let pairs = r
            .backoff
            .pairs
            .iter()
            .filter(|p| p.a == v.vm || p.b == v.vm);
        if let Some(ms) = pairs.map(|p| p.backoff_ms).reduce(f64::max) {
            m.backoff(&v.vm, "cluster-snapshot", ms);
        }
    }
}

/// Records a restore of one VM.
pub fn record_restore(r: &crate::restore::Report) {
    metrics().restore(&r.vm, r.restore_latency_ms, r.demand_faults);
}

/// Records a cluster restore: each VM's latency, demand faults and backoff.
pub fn record_cluster_restore(r: &crate::cluster_restore::ClusterRestoreReport) {
    let m = metrics();
    for v in &r.vms {
        m.restore(&v.vm, v.latency_ms, v.demand_faults);
        m.backoff(&v.vm, "cluster-restore", v.backoff_ms);
    }
}

/// Records rejuvenations.
pub fn record_rejuvenations(reports: &[crate::rejuvenate::Report]) {
    for r in reports {
        let l = Vm { vm: r.vm.clone() };
        (metrics().rejuvenation.get_or_create(&l)).observe(r.downtime_ms / 1000.0);
    }
}

/// Everything recorded so far, in the OpenMetrics text format (which
/// Prometheus scrapes), ending with `# EOF`.
pub fn render() -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &metrics().registry);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    fn count(text: &str, series: &str) -> u64 {
        let line = text.lines().find(|l| l.starts_with(series));
        line.and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    }

    #[test]
    fn served_text_counts_what_was_recorded() {
        let addr = crate::metrics_endpoint::serve("127.0.0.1:0".parse().unwrap(), render).unwrap();
        let series = r#"vmcsnap_restore_latency_seconds_count{vm="unit-test-vm"}"#;
        let scrape = || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
            let mut text = String::new();
            s.read_to_string(&mut text).unwrap();
            assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
            assert!(text.trim_end().ends_with("# EOF"), "{text}");
            text
        };
        let before = count(&scrape(), series);
        metrics().restore("unit-test-vm", 12.5, 3);
        let text = scrape();
        assert_eq!(count(&text, series), before + 1, "{text}");
        let faults = r#"vmcsnap_demand_faults_total{vm="unit-test-vm"}"#;
        assert!(count(&text, faults) >= 3, "{text}");
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        assert!(text.starts_with("HTTP/1.1 404"), "{text}");
    }
}
