//! The availability model of the warm-VM reboot paper (Kourai & Chiba,
//! IEEE TDSC, §3.2 and §5.5), fed with downtimes vmcsnap measured.
//!
//! The VMM is rejuvenated every `T_vmm`, each guest OS every `T_os`
//! (time-based rejuvenation). With `D(n)` the downtime of rejuvenating the
//! VMM of `n` VMs and `D_os` that of rebooting one OS:
//!
//! ```text
//! warm:  A_w = 1 - (D_w(n) + N_w  * D_os) / T_vmm,   N_w = (T_vmm - D_w(n)) / T_os     (1)
//! cold:  A_c = 1 - (D_c(n) + ⌊N_c⌋ * D_os) / T_vmm,  N_c = (T_vmm - D_c(n)) / T_os     (2)
//! saved: A_s = 1 - (D_s(n) + N_s  * D_os) / T_vmm,   N_s = (T_vmm - D_s(n)) / T_os
//! ```
//!
//! A warm or saved restart keeps the guests running, so the OS timer just
//! pauses (`N` is an average); a cold VMM reboot also reboots every OS and
//! resets its timer (only whole OS rejuvenations count, and the one done
//! with the VMM is part of `D_c`).

use serde::Serialize;

/// Which formula.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Equation (1).
    Warm,
    /// Equation (2).
    Cold,
    /// §5.5's saved-VM reboot.
    Saved,
}

/// Availability for a VMM downtime `d_vmm`, OS reboot downtime `d_os`, and
/// the two rejuvenation intervals, all in seconds.
pub fn availability(kind: Kind, d_vmm: f64, d_os: f64, t_vmm: f64, t_os: f64) -> f64 {
    let n = (t_vmm - d_vmm) / t_os;
    let n = if kind == Kind::Cold { n.floor() } else { n };
    1.0 - (d_vmm + n * d_os) / t_vmm
}

/// Downtimes measured on this host, from the agent's rejuvenation log
/// (`<run-dir>/rejuvenations.jsonl`, one JSON object per `rejuvenate`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Measured {
    /// Latest warm restart: (number of VMs, longest per-VM downtime, s).
    pub warm: Option<(usize, f64)>,
    /// Latest saved restart.
    pub saved: Option<(usize, f64)>,
    /// Latest cold restart.
    pub cold: Option<(usize, f64)>,
    /// Rebooting one guest OS: median per-VM downtime of the latest cold restart, s.
    pub os_reboot: Option<f64>,
}

/// Reads the measurements from the log's text (unparseable lines are skipped).
pub fn measured_from_log(text: &str) -> Measured {
    let mut m = Measured::default();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let downs: Vec<f64> = v["reports"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["downtime_ms"].as_f64())
            .map(|ms| ms / 1000.0)
            .collect();
        if downs.is_empty() {
            continue;
        }
        let max = downs.iter().cloned().fold(0.0, f64::max);
        let entry = Some((downs.len(), max));
        match v["mode"].as_str() {
            Some("warm") => m.warm = entry,
            Some("saved") => m.saved = entry,
            Some("cold") => {
                m.cold = entry;
                let mut sorted = downs.clone();
                sorted.sort_by(f64::total_cmp);
                m.os_reboot = Some(sorted[sorted.len() / 2]);
            }
            _ => {}
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: f64 = 86_400.0;

    /// §5.5: D_w(11) = 43 s, D_c(11) = 243 s, D_s(11) = 434 s, D_os = 34 s,
    /// OS weekly and VMM every four weeks give 0.99993, 0.99986, 0.99977.
    #[test]
    fn reproduces_the_papers_example() {
        let a = |k, d| availability(k, d, 34.0, 28.0 * DAY, 7.0 * DAY);
        assert!(
            (a(Kind::Warm, 43.0) - 0.99993).abs() < 0.5e-5,
            "{}",
            a(Kind::Warm, 43.0)
        );
        assert!(
            (a(Kind::Cold, 243.0) - 0.99986).abs() < 0.5e-5,
            "{}",
            a(Kind::Cold, 243.0)
        );
        // The paper prints 0.99977; equation gives 0.999764 (rounding in the paper).
        assert!(
            (a(Kind::Saved, 434.0) - 0.99977).abs() < 1.0e-5,
            "{}",
            a(Kind::Saved, 434.0)
        );
    }

    #[test]
    fn log_gives_latest_batch_per_mode_and_median_cold_reboot() {
        let log = concat!(
            r#"{"mode":"warm","n":1,"reports":[{"downtime_ms":500.0}]}"#,
            "\n",
            r#"{"mode":"warm","n":2,"reports":[{"downtime_ms":100.0},{"downtime_ms":120.0}]}"#,
            "\n",
            "garbage\n",
            r#"{"mode":"cold","n":3,"reports":[{"downtime_ms":7000.0},{"downtime_ms":5000.0},{"downtime_ms":9000.0}]}"#,
            "\n",
        );
        let m = measured_from_log(log);
        assert_eq!(m.warm, Some((2, 0.12)));
        assert_eq!(m.cold, Some((3, 9.0)));
        assert_eq!(m.os_reboot, Some(7.0));
        assert_eq!(m.saved, None);
    }

    #[test]
    fn shorter_vmm_downtime_means_higher_availability() {
        let (t_vmm, t_os) = (28.0 * DAY, 7.0 * DAY);
        let w = availability(Kind::Warm, 0.1, 30.0, t_vmm, t_os);
        let s = availability(Kind::Saved, 5.0, 30.0, t_vmm, t_os);
        assert!(w > s && w < 1.0);
        // Cold counts only whole OS rejuvenations: with T_os > T_vmm, none.
        assert_eq!(
            availability(Kind::Cold, 10.0, 30.0, DAY, 2.0 * DAY),
            1.0 - 10.0 / DAY
        );
    }
}
