//! Where a guest's TCP counters come from.
//!
//! The lab guest prints them on its console once a second (`vmcsnap-stat`
//! lines, see [`crate::guest_console::parse_console`]); that path is
//! unchanged and still waits for stat lines where the reports need them.
//! An image VM (a real distribution image, [`QemuConfig::image`]) prints no
//! such lines: its counters are read from `/proc/net` through its guest
//! agent (qemu-guest-agent, [`vmcsnap_qmp::ga`]) at the moments the lab
//! path reads its stat lines. A guest without a working agent gives `None`
//! for every counter: the reports say `?` (unknown), never 0.

use std::time::Duration;

use vmcsnap_qmp::ga;

use crate::guest_console::GuestView;
use crate::qemu::QemuConfig;
use vmcsnap_control::TcpCounters;

/// How long an image VM's guest agent gets to give its counters (it is
/// slow under TCG, and slower still in a restored guest loading its pages).
pub const GUEST_AGENT_WAIT: Duration = Duration::from_secs(2);

/// The guest agent's counters as the reports carry them.
fn counters(c: ga::TcpCounters) -> TcpCounters {
    TcpCounters {
        retrans: Some(c.retrans_segs),
        tlp: c.tcp_loss_probes,
        tlp_recovered: c.tcp_loss_probe_recovery,
        rto: c.tcp_timeouts,
        dsack: c.dsack_total(),
    }
}

/// Whether `config`'s counters come from the guest agent (an image VM)
/// rather than console stat lines (the lab guest).
pub fn from_agent(config: &QemuConfig) -> bool {
    config.image.is_some()
}

/// The guest's TCP counters now: the lab guest's last console stat line,
/// or an image VM's reading through its guest agent. `None`: unknown (no
/// stat line yet, or no agent answered within [`GUEST_AGENT_WAIT`]).
pub fn guest_counters(config: &QemuConfig) -> Option<TcpCounters> {
    match &config.image {
        None => {
            let c = crate::guest_console::tcp_now(&config.console_log);
            c.retrans.map(|_| c)
        }
        Some(image) => match ga::read_tcp_counters(&image.qga_socket, GUEST_AGENT_WAIT) {
            Ok(c) => Some(counters(c)),
            Err(e) => {
                tracing::warn!("VM {}: its TCP counters are unknown: {e}", config.name);
                None
            }
        },
    }
}

/// [`guest_counters`] of several VMs at once (one thread each: guest
/// agents that do not answer cost [`GUEST_AGENT_WAIT`] once, not per VM).
pub fn guest_counters_all(configs: &[&QemuConfig]) -> Vec<Option<TcpCounters>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = configs
            .iter()
            .map(|c| s.spawn(move || guest_counters(c)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(None))
            .collect()
    })
}

/// What an image VM's guest agent said, as the view its console would
/// give: `first` and `later` readings (`stat_lines` counts those known;
/// no pingpong lines).
pub fn agent_view(first: Option<TcpCounters>, later: Option<TcpCounters>) -> GuestView {
    GuestView {
        tcp: later.unwrap_or_default(),
        tcp_first: first.unwrap_or_default(),
        pingpong_max_gap_ms: None,
        stat_lines: u64::from(first.is_some()) + u64::from(later.is_some()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qemu::ImageDevices;

    fn config(dir: &std::path::Path, image: bool) -> QemuConfig {
        let mut c: QemuConfig = serde_json::from_value(serde_json::json!({
            "name": "a", "accel": "tcg", "memory_mib": 64, "vcpus": 1,
            "ram_file": "/r", "kernel": "/k", "console_log": dir.join("console.log"), "qmp_socket": "/q",
            "disks": [], "port_socket": "/p", "mac": "52:54:00:00:00:01", "incoming": false
        }))
        .unwrap();
        if image {
            c.image = Some(ImageDevices {
                qga_socket: dir.join("qga.sock"),
                events_log: dir.join("events.log"),
                workload_file: None,
            });
        }
        c
    }

    #[test]
    fn the_lab_guest_reads_its_console() {
        let d = tempfile::tempdir().unwrap();
        let lab = config(d.path(), false);
        assert_eq!(guest_counters(&lab), None, "no console yet");
        std::fs::write(
            &lab.console_log,
            "vmcsnap-stat name=a uptime=1.0 retrans=7 tlp=2 tlprec=0 rto=1 dsack=3\n",
        )
        .unwrap();
        let c = guest_counters(&lab).unwrap();
        assert_eq!((c.retrans, c.tlp, c.dsack), (Some(7), Some(2), Some(3)));
        assert!(!from_agent(&lab));
    }

    #[test]
    fn an_image_vm_without_an_agent_is_unknown_not_zero() {
        let d = tempfile::tempdir().unwrap();
        let img = config(d.path(), true);
        // Stat lines on an image VM's console are not its counters' source.
        std::fs::write(
            &img.console_log,
            "vmcsnap-stat name=a uptime=1.0 retrans=7\n",
        )
        .unwrap();
        // A socket that accepts and never answers, like QEMU's port of a
        // guest without qemu-guest-agent.
        let _listener =
            std::os::unix::net::UnixListener::bind(&img.image.as_ref().unwrap().qga_socket)
                .unwrap();
        assert!(from_agent(&img));
        assert_eq!(
            guest_counters_all(&[&img, &config(d.path(), false)]),
            vec![None, guest_counters(&config(d.path(), false))]
        );
        let v = agent_view(None, None);
        assert_eq!(
            (v.tcp.retrans, v.tcp_first.retrans, v.stat_lines),
            (None, None, 0)
        );
    }

    #[test]
    fn agent_counters_map_onto_the_stat_line_fields() {
        let c = counters(ga::TcpCounters {
            retrans_segs: 12,
            tcp_loss_probes: Some(3),
            tcp_loss_probe_recovery: Some(1),
            tcp_timeouts: Some(2),
            dsack_recv: Some(4),
            dsack_ofo_recv: Some(1),
        });
        assert_eq!(
            c,
            TcpCounters {
                retrans: Some(12),
                tlp: Some(3),
                tlp_recovered: Some(1),
                rto: Some(2),
                dsack: Some(5)
            }
        );
        let v = agent_view(
            Some(TcpCounters {
                retrans: Some(9),
                ..c
            }),
            Some(c),
        );
        assert_eq!(
            (v.tcp_first.retrans, v.tcp.retrans, v.stat_lines),
            (Some(9), Some(12), 2)
        );
        assert_eq!(
            v.tcp.growth_since(&v.tcp_first).lost(),
            Some(3),
            "3 retransmissions, no new duplicate SACK"
        );
    }
}
