//! Errors of spec parsing and validation.

use thiserror::Error;

/// Everything that can be wrong with a cluster spec. Each message names the
/// offending field or VM so the user can fix the file.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SpecError {
    /// The TOML itself or its shape is wrong (unknown field, wrong type, ...).
    #[error("{0}")]
    Toml(String),
    /// The spec defines no VM.
    #[error("the spec defines no VM: add at least one [[vm]] table")]
    NoVms,
    /// More VMs than vmcsnap can address on its /24.
    #[error("the spec defines {0} VMs; at most {max} are supported", max = crate::MAX_VMS)]
    TooManyVms(usize),
    /// A cluster or VM name that is not usable in file and socket names.
    #[error("invalid {what} name {name:?}: use 1-{max} characters of a-z, 0-9 and '-', starting with a letter")]
    BadName {
        /// "cluster" or "VM".
        what: &'static str,
        /// The rejected name.
        name: String,
        /// The maximum length.
        max: usize,
    },
    /// `boot_timeout_s` outside 1..=[`MAX_BOOT_TIMEOUT_S`](crate::MAX_BOOT_TIMEOUT_S).
    #[error("[cluster] boot_timeout_s = {0} is out of range: give 1-{max} seconds (a day at most)", max = crate::MAX_BOOT_TIMEOUT_S)]
    BootTimeoutOutOfRange(u64),
    /// Two VMs share a name.
    #[error("duplicate VM name {0:?}: every [[vm]] needs its own name")]
    DuplicateVm(String),
    /// A VM has less memory than the guest needs.
    #[error("VM {vm:?}: memory_mib = {got} is below the guest's minimum of {min} MiB")]
    MemoryTooSmall {
        /// The VM.
        vm: String,
        /// What the spec says.
        got: u64,
        /// The minimum.
        min: u64,
    },
    /// A numeric field out of its range.
    #[error("VM {vm:?}: {field} = {got} is out of range ({range})")]
    OutOfRange {
        /// The VM.
        vm: String,
        /// The field.
        field: &'static str,
        /// What the spec says.
        got: u64,
        /// The allowed range, for the message.
        range: &'static str,
    },
    /// A workload refers to `{ip:NAME}` of a VM that is not in the spec.
    #[error(
        "VM {vm:?}: workload refers to {{ip:{target}}} but the spec has no VM named {target:?}"
    )]
    UnknownWorkloadVm {
        /// The VM whose workload is wrong.
        vm: String,
        /// The missing name.
        target: String,
    },
    /// A workload has a `{...}` placeholder vmcsnap does not know.
    #[error(
        "VM {vm:?}: unknown placeholder {placeholder:?} in workload (known: {{ip:NAME}}, {{name}})"
    )]
    UnknownPlaceholder {
        /// The VM whose workload is wrong.
        vm: String,
        /// The placeholder text.
        placeholder: String,
    },
    /// `image_suite` without `image_recipe`.
    #[error("VM {0:?}: image_suite needs image_recipe (it chooses the Debian release of an image vmcsnap builds; a user's image brings its own)")]
    SuiteNeedsRecipe(String),
    /// `image` and `image_recipe` are both set.
    #[error("VM {0:?}: image and image_recipe are mutually exclusive: keep one")]
    ImageAndRecipe(String),
    /// A field that only image VMs have, on a lab VM.
    #[error("VM {vm:?}: {field} needs image or image_recipe (the lab guest brings its own kernel, disk and init)")]
    NeedsImage {
        /// The VM.
        vm: String,
        /// The field, as written in the spec (e.g. `machine = "q35"`).
        field: &'static str,
    },
    /// A field that only applies to direct kernel boot, without `kernel`.
    #[error("VM {vm:?}: {field} needs kernel (it only applies to direct kernel boot)")]
    NeedsKernel {
        /// The VM.
        vm: String,
        /// The field.
        field: &'static str,
    },
    /// `machine = "microvm"` on an image VM without `kernel`.
    #[error("VM {0:?}: machine = microvm needs kernel (microvm has no firmware that boots a disk); set kernel or use machine = \"q35\"")]
    MicrovmNeedsKernel(String),
    /// `ssh_authorized_keys` with `cloud_init = false`.
    #[error("VM {0:?}: ssh_authorized_keys needs cloud_init = true (the keys are delivered through the NoCloud seed)")]
    KeysNeedCloudInit(String),
    /// A wrong entry of `ssh_authorized_keys`.
    #[error("VM {vm:?}: ssh_authorized_keys: {reason}")]
    BadSshKeys {
        /// The VM.
        vm: String,
        /// What is wrong.
        reason: String,
    },
    /// A wrong entry of `disks`.
    #[error("VM {vm:?}: disks[{index}]: {reason}")]
    BadDisk {
        /// The VM.
        vm: String,
        /// 0-based position in `disks`.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// A path field that is empty.
    #[error("VM {vm:?}: {field} is an empty path")]
    EmptyPath {
        /// The VM.
        vm: String,
        /// The field.
        field: &'static str,
    },
    /// More devices than the machine has slots for.
    #[error("VM {vm:?}: machine = {machine} holds {max} virtio devices but this VM needs {got} (NIC, console channels, root, seed, disks): give it at most {max_disks} disks{hint}", hint = if *machine == crate::Machine::Microvm { " or use machine = \"q35\"" } else { "" })]
    TooManyDevices {
        /// The VM.
        vm: String,
        /// Its machine type.
        machine: crate::Machine,
        /// Devices needed.
        got: usize,
        /// Slots available.
        max: usize,
        /// The most `disks` entries it can have (with its seed, if any).
        max_disks: usize,
    },
    /// A lab-guest field on an image VM.
    #[error("VM {vm:?}: {field} applies only to the lab guest; {instead}")]
    LabOnly {
        /// The VM.
        vm: String,
        /// The field.
        field: &'static str,
        /// What to use instead.
        instead: &'static str,
    },
}
