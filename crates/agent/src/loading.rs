//! Restores that answer once their guests run: the rest of the pages loads
//! in the background while the request goes on (holding the cluster, so
//! later operations wait for it), and `status` shows how far each VM is.
//!
//! ```text
//!  restore request ──▶ guests start ──▶ Early::reply (the client has its
//!       │                                answer: latency to running)
//!       │              Early::show (status lists the restored VMs) and
//!       │              Loads::set per progress report (pages loaded / total)
//!       └──▶ every page loaded ──▶ the VMs join the cluster, Loads cleared,
//!                                  the full report goes to the log
//! ```
//!
//! With `--wait` the request answers only at the full load, with the full
//! report (as before: both times, latency and full load).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use vmcsnap_control::{StatusResult, VmLoad, VmStatus};

/// What a request may do before it ends.
pub trait Early: Sync {
    /// Answers the client with `result` now; the request goes on, and its
    /// final outcome goes to the log only. Later calls do nothing.
    fn reply(&self, result: vmcsnap_control::Response);
    /// While the request goes on, `status` lists `vms` too (the VMs it
    /// restored, before they join the cluster), in a cluster named
    /// `cluster` (with `accel`) if none is up.
    fn show(&self, cluster: &str, accel: &str, vms: Vec<VmStatus>);
}

/// An [`Early`] that never answers early (a request run without a client
/// that could take it, and tests).
pub struct NoEarly;

impl Early for NoEarly {
    fn reply(&self, _: vmcsnap_control::Response) {}
    fn show(&self, _: &str, _: &str, _: Vec<VmStatus>) {}
}

/// What a restore request gets to answer early: the connection, and the
/// board `status` reads the loads from.
pub struct Ctx<'a> {
    /// The request's connection.
    pub early: &'a dyn Early,
    /// The agent's board of background loads.
    pub loads: Loads,
}

/// Per VM, how far its background load is.
#[derive(Clone, Default)]
pub struct Loads(Arc<Mutex<BTreeMap<String, VmLoad>>>);

impl Loads {
    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, VmLoad>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `vm` has `loaded` of its `total` pages.
    pub fn set(&self, vm: &str, loaded: u64, total: u64) {
        let load = VmLoad {
            pages_loaded: loaded.min(total),
            pages_total: total,
        };
        self.map().insert(vm.to_string(), load);
    }

    /// `vm` has every page (or its restore ended).
    pub fn done(&self, vm: &str) {
        self.map().remove(vm);
    }

    /// Every load ended.
    pub fn clear(&self) {
        self.map().clear();
    }

    /// Fills the `load` of each VM of `status` that is loading.
    pub fn apply(&self, status: &mut StatusResult) {
        let map = self.map();
        for v in &mut status.vms {
            v.load = map.get(&v.name).copied();
        }
    }
}

/// `status` as the view shows it plus `vms` shown by a request (see
/// [`Early::show`]): VMs of the same name are replaced.
pub fn merge(status: &mut StatusResult, cluster: &str, accel: &str, vms: Vec<VmStatus>) {
    if status.cluster.is_none() {
        status.cluster = Some(cluster.to_string());
        status.accel = Some(accel.to_string());
    }
    status.vms.retain(|v| !vms.iter().any(|n| n.name == v.name));
    status.vms.extend(vms);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(name: &str) -> VmStatus {
        VmStatus {
            name: name.into(),
            pid: 1,
            state: "running".into(),
            ip: String::new(),
            mac: String::new(),
            memory_mib: 128,
            uptime_s: 0.0,
            port: name.into(),
            load: None,
        }
    }

    #[test]
    fn status_shows_the_loads_of_restored_vms() {
        let mut st = crate::dispatch::idle_status();
        merge(&mut st, "c", "kvm", vec![vm("a"), vm("b")]);
        assert_eq!(st.cluster.as_deref(), Some("c"));
        let loads = Loads::default();
        loads.set("a", 10, 100);
        loads.set("b", 500, 100);
        loads.apply(&mut st);
        let load = |i: usize| st.vms[i].load.map(|l| (l.pages_loaded, l.pages_total));
        assert_eq!((load(0), load(1)), (Some((10, 100)), Some((100, 100))));
        loads.done("a");
        loads.apply(&mut st);
        assert_eq!(st.vms[0].load, None);
        // A VM shown again replaces the one of its name.
        merge(&mut st, "other", "tcg", vec![vm("a")]);
        assert_eq!(st.vms.len(), 2);
        assert_eq!(st.cluster.as_deref(), Some("c"));
    }
}
