//! Human and JSON output.

use anyhow::Result;
use serde_json::Value;
use vmcsnap_control::{StatusResult, UpResult};
use vmcsnap_switch::SwitchStats;

/// Prints `v` as JSON if `json`, else runs `human`.
pub fn json_or(json: bool, v: &Value, human: impl FnOnce()) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(v)?);
    } else {
        human();
    }
    Ok(())
}

/// The table printed by `up`.
pub fn up(r: &UpResult) {
    println!("cluster {} is up", r.cluster);
    println!("{:<12} {:>8} {:>8} {:<5} {:<16} {}", "VM", "PID", "BOOT_MS", "ACCEL", "IP", "MAC");
    for v in &r.vms {
        println!("{:<12} {:>8} {:>8} {:<5} {:<16} {}", v.name, v.pid, v.boot_ms, v.accel, v.ip, v.mac);
    }
}

/// The table printed by `status`.
pub fn status(s: &StatusResult, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    let Some(name) = &s.cluster else {
        println!("no cluster is up");
        return Ok(());
    };
    println!("cluster {name} ({}), agent pid {}", s.accel.as_deref().unwrap_or("?"), s.agent_pid);
    println!("{:<12} {:>8} {:<10} {:<16} {:>7} {:>9}", "VM", "PID", "STATE", "IP", "MEM_MIB", "UPTIME_S");
    for v in &s.vms {
        println!(
            "{:<12} {:>8} {:<10} {:<16} {:>7} {:>9.1}",
            v.name, v.pid, v.state, v.ip, v.memory_mib, v.uptime_s
        );
    }
    if let Ok(sw) = serde_json::from_value::<SwitchStats>(s.switch.clone()) {
        println!();
        println!("{:<12} {:>10} {:>12} {:>10} {:>12} {:>6}", "PORT", "RX_FRAMES", "RX_BYTES", "TX_FRAMES", "TX_BYTES", "DROPS");
        for p in &sw.ports {
            let c = &p.counters;
            println!(
                "{:<12} {:>10} {:>12} {:>10} {:>12} {:>6}",
                p.name, c.rx_frames, c.rx_bytes, c.tx_frames, c.tx_bytes, c.drops
            );
        }
    }
    Ok(())
}

/// The table printed by `rejuvenate`.
pub fn rejuvenate(v: &Value) {
    println!(
        "{:<12} {:<6} {:>8} {:>12} {:>9} {:>11} {:>9} {:>12} {:>7}",
        "VM", "MODE", "MEM_MIB", "DOWNTIME_MS", "SAVE_MS", "RESTART_MS", "LOAD_MS", "STATE_BYTES", "HELD"
    );
    for r in v["reports"].as_array().into_iter().flatten() {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        println!(
            "{:<12} {:<6} {:>8} {:>12.1} {:>9.1} {:>11.1} {:>9.1} {:>12} {:>7}",
            r["vm"].as_str().unwrap_or("?"),
            r["mode"].as_str().unwrap_or("?"),
            r["memory_mib"],
            f("downtime_ms"),
            f("save_ms"),
            f("restart_ms"),
            f("load_ms"),
            r["state_bytes"],
            r["frames_held"]
        );
    }
    println!("total {:.1} ms", v["total_ms"].as_f64().unwrap_or(0.0));
}
