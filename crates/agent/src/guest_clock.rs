//! Setting a restored guest's clock to the host's.
//!
//! A restored guest resumes with the clock it had at the snapshot: its
//! wall clock lags the host's by the snapshot's age (12-89 s measured in
//! issue 29; a consensus store logged "high clock drift"). After every
//! restore and cluster restore, where the guest agent answers (image VMs:
//! `org.qemu.guest_agent.0`), the agent sets the guest's clock to the
//! host's as `virsh domtime --sync` does: `guest-set-time` with the host's
//! time (the guest agent sets the system clock, then the RTC with
//! `/sbin/hwclock -w`). A guest without hwclock (Debian bookworm keeps it
//! in util-linux-extra, which minimal images lack) fails that command; if
//! its clock was not set either, `date -u -s @SECONDS` runs through
//! `guest-exec`. The result goes into the restore's report ([`ClockSync`]).
//!
//! The lab guest has no guest agent: its clock keeps the snapshot's time
//! and lags the host by the snapshot's age; a VM restored `--paused` is not
//! running: its clock is not set (docs/restore.md, "The guest's clock").

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use vmcsnap_qmp::ga::{GaError, GuestAgent};

use crate::qemu::QemuConfig;

/// How long the guest agent gets to answer each request (a guest restored
/// lazily under TCG may take seconds to fault its agent's pages in).
pub const GUEST_AGENT_WAIT: Duration = Duration::from_secs(15);
/// A clock within this of the host's counts as set.
const SET_WITHIN_MS: f64 = 1000.0;

pub use vmcsnap_control::{ClockOutcome as Outcome, ClockSync};

/// Sets the clock of the guest of `config` (running unless `paused`).
pub fn sync(config: &QemuConfig, paused: bool) -> ClockSync {
    let Some(image) = &config.image else {
        return ClockSync::new(&config.name, Outcome::NoAgent);
    };
    if paused {
        return ClockSync::new(&config.name, Outcome::Paused);
    }
    let mut r = ClockSync::new(&config.name, Outcome::Failed);
    if let Err(e) = sync_through(&image.qga_socket, GUEST_AGENT_WAIT, &mut r) {
        r.outcome = Outcome::Failed;
        r.error = Some(e.to_string());
    }
    tracing::info!(vm = %config.name, outcome = ?r.outcome, method = ?r.method,
        before_ms = ?r.offset_before_ms, after_ms = ?r.offset_after_ms, error = ?r.error,
        "guest clock after the restore");
    r
}

/// `config` of a VM restored into `vm_dir`: its guest agent's socket is
/// there (a restore moves a VM's ports to its new directory).
pub fn restored_in(config: &QemuConfig, vm_dir: &std::path::Path) -> QemuConfig {
    let mut c = config.clone();
    if let Some(dev) = c.image.as_mut() {
        dev.qga_socket = vm_dir.join("qga.sock");
    }
    c
}

/// Sets every clock at once (one thread per VM: each may wait for its agent).
pub fn sync_all<'a>(configs: impl IntoIterator<Item = &'a QemuConfig>) -> Vec<ClockSync> {
    std::thread::scope(|s| {
        let handles: Vec<_> = configs
            .into_iter()
            .map(|c| s.spawn(move || sync(c, false)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a clock sync thread does not panic"))
            .collect()
    })
}

fn sync_through(socket: &Path, wait: Duration, r: &mut ClockSync) -> Result<(), GaError> {
    let mut ga = GuestAgent::connect(socket, wait)?;
    r.offset_before_ms = Some(offset_ms(&mut ga)?);
    let set = ga.set_time_ns(host_ns());
    let mut after = offset_ms(&mut ga)?;
    r.method = Some("guest-set-time".into());
    if let Err(e) = set {
        if after.abs() > SET_WITHIN_MS {
            // The agent did not set the system clock (no hwclock): `date`.
            let t = host_ns();
            let at = format!("@{}.{:09}", t / 1_000_000_000, t % 1_000_000_000);
            let out = ga.exec("/bin/date", &["-u", "-s", &at])?;
            if !out.success() {
                return Err(GaError::Protocol(format!(
                    "guest-set-time failed ({e}), and so did date -s in the guest: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
            after = offset_ms(&mut ga)?;
            r.method = Some("date (guest-exec; guest-set-time failed)".into());
        } else {
            tracing::debug!("guest-set-time set the clock but said: {e}");
        }
    }
    r.offset_after_ms = Some(after);
    r.outcome = if after.abs() <= SET_WITHIN_MS {
        Outcome::Set
    } else {
        r.error = Some(format!("the guest's clock is still {after:+.0} ms off"));
        Outcome::Failed
    };
    Ok(())
}

/// The guest's clock minus the host's, ms, the host's read around the
/// request (its midpoint).
fn offset_ms(ga: &mut GuestAgent) -> Result<f64, GaError> {
    let before = host_ns();
    let guest = ga.get_time_ns()?;
    let after = host_ns();
    let host = before + (after - before) / 2;
    Ok((guest - host) as f64 / 1e6)
}

fn host_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qemu::ImageDevices;

    fn config(image: Option<ImageDevices>) -> QemuConfig {
        serde_json::from_value(serde_json::json!({
            "name": "w", "accel": "tcg", "memory_mib": 256, "vcpus": 1, "ram_file": "/r",
            "kernel": null, "console_log": "/c", "qmp_socket": "/q", "disks": "/d.qcow2",
            "port_socket": "/p", "mac": "52:54:00:77:00:02", "incoming": false,
            "image": image,
        }))
        .unwrap()
    }

    #[test]
    fn a_lab_guest_or_a_paused_one_is_left_alone_and_says_why() {
        let lab = sync(&config(None), false);
        assert_eq!(lab.outcome, Outcome::NoAgent);
        let d = tempfile::tempdir().unwrap();
        let image = ImageDevices {
            qga_socket: d.path().join("qga.sock"),
            events_log: d.path().join("events.log"),
            workload_file: None,
        };
        assert_eq!(sync(&config(Some(image)), true).outcome, Outcome::Paused);
    }

    #[test]
    fn an_agent_that_does_not_answer_is_a_failure_with_the_reason() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("qga.sock");
        // QEMU's side of a guest without an agent: accepts, never answers.
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let mut r = ClockSync::new("w", Outcome::Failed);
        let e = sync_through(&sock, Duration::from_millis(300), &mut r).unwrap_err();
        assert!(e.to_string().contains("does not answer"), "{e}");
        assert_eq!(r.offset_before_ms, None);
    }
}
