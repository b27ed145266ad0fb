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
