//! Choosing the accelerator.
//!
//! `auto` uses KVM only where KVM can really run a stock guest. A host whose
//! `/dev/kvm` is served by `kvm_pvm` (a nested paravirtual KVM) opens and
//! creates VMs fine but dies emulating XSAVE/POPCNT/CLAC in a stock kernel,
//! so such a host counts as having no usable KVM.

use std::fs::OpenOptions;
use std::path::Path;

use vmcsnap_spec::Accel;

use crate::AgentError;

/// The accelerator QEMU will use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resolved {
    /// Hardware virtualisation.
    Kvm,
    /// Software emulation.
    Tcg,
}

impl Resolved {
    /// `kvm` or `tcg`.
    pub fn name(self) -> &'static str {
        match self {
            Resolved::Kvm => "kvm",
            Resolved::Tcg => "tcg",
        }
    }

    /// QEMU arguments selecting it.
    pub fn qemu_args(self) -> [&'static str; 4] {
        match self {
            Resolved::Kvm => ["-accel", "kvm", "-cpu", "host"],
            Resolved::Tcg => ["-accel", "tcg", "-cpu", "max"],
        }
    }
}

/// Why KVM cannot be used here, or `None` if it can.
pub fn kvm_problem(sys_module: &Path, dev_kvm: &Path) -> Option<String> {
    if let Err(e) = OpenOptions::new().read(true).write(true).open(dev_kvm) {
        return Some(format!("{} cannot be opened ({e})", dev_kvm.display()));
    }
    if sys_module.join("kvm_pvm").exists() {
        return Some(format!(
            "{} is served by kvm_pvm, a nested paravirtual KVM that cannot run a stock Linux guest",
            dev_kvm.display()
        ));
    }
    None
}

/// Resolves the spec's choice on this host. The note, if any, explains an
/// `auto` fallback and should be logged once.
pub fn resolve(requested: Accel) -> Result<(Resolved, Option<String>), AgentError> {
    resolve_on(requested, Path::new("/sys/module"), Path::new("/dev/kvm"))
}

/// [`resolve`] with the host's paths given (for tests).
pub fn resolve_on(
    requested: Accel,
    sys_module: &Path,
    dev_kvm: &Path,
) -> Result<(Resolved, Option<String>), AgentError> {
    match (requested, kvm_problem(sys_module, dev_kvm)) {
        (Accel::Tcg, _) => Ok((Resolved::Tcg, None)),
        (Accel::Kvm, None) | (Accel::Auto, None) => Ok((Resolved::Kvm, None)),
        (Accel::Kvm, Some(why)) => Err(AgentError::KvmUnusable(why)),
        (Accel::Auto, Some(why)) => {
            Ok((Resolved::Tcg, Some(format!("accel auto: {why}; using TCG"))))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_falls_back_to_tcg_on_kvm_pvm_and_says_why() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("kvm_pvm")).unwrap();
        let kvm = d.path().join("kvm");
        std::fs::write(&kvm, b"").unwrap();
        let (r, note) = resolve_on(Accel::Auto, d.path(), &kvm).unwrap();
        assert_eq!(r, Resolved::Tcg);
        assert!(note.unwrap().contains("kvm_pvm"));
        let e = resolve_on(Accel::Kvm, d.path(), &kvm).unwrap_err();
        assert!(e.to_string().contains("kvm_pvm"), "{e}");
    }

    #[test]
    fn auto_uses_kvm_when_usable_and_tcg_without_dev_kvm() {
        let d = tempfile::tempdir().unwrap();
        let kvm = d.path().join("kvm");
        std::fs::write(&kvm, b"").unwrap();
        assert_eq!(
            resolve_on(Accel::Auto, d.path(), &kvm).unwrap().0,
            Resolved::Kvm
        );
        let (r, note) = resolve_on(Accel::Auto, d.path(), &d.path().join("none")).unwrap();
        assert_eq!(r, Resolved::Tcg);
        assert!(note.is_some());
        assert_eq!(
            resolve_on(Accel::Tcg, d.path(), &kvm).unwrap(),
            (Resolved::Tcg, None)
        );
    }
}
