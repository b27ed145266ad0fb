//! The two kinds of guest a `[[vm]]` can be, and the fields of image VMs.
//!
//! A VM without `image` or `image_recipe` is vmcsnap's **lab guest**: a
//! microvm booting the busybox initramfs vmcsnap builds, with one data disk
//! (`disk_mib`) and its workload on the kernel command line. Nothing of the
//! fields below applies to it.
//!
//! A VM with `image` (a qcow2 or raw root disk the user brings) or
//! `image_recipe` (an image `vmcsnap image build` makes, from the Debian
//! release `image_suite`) is an **image VM**: a Debian/Ubuntu system that boots through its own bootloader
//! (SeaBIOS + GRUB on q35) or directly from a `kernel`, runs on a qcow2
//! overlay of the image, may get extra `disks` and a cloud-init NoCloud seed.
//!
//! [`VmSpec::kind`](crate::VmSpec::kind) resolves the defaults once, so that
//! callers branch on [`GuestKind`] and never re-derive them.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The guest memory floor of image VMs, in MiB (systemd and a database need
/// more than the lab guest's floor).
pub const IMAGE_MIN_MEMORY_MIB: u64 = 256;

/// How many virtio devices vmcsnap attaches to a microvm. QEMU 7.2's
/// `microvm,acpi=on` accepts 24 (its virtio-mmio transports; a 25th fails
/// with "No 'virtio-bus' bus found"), and a guest saw 9 of them work (7
/// disks), but one with 24 never finished probing them in our runs: 8, the
/// number every microvm guest handles, until more is shown to work.
pub const MICROVM_VIRTIO_SLOTS: usize = 8;

/// How many PCI devices vmcsnap can plug into a q35: slots 1-30 of its
/// root bus (slot 0 is the host bridge, 31 the ICH9 LPC, SATA and SMBus
/// functions; vmcsnap plugs one device per slot). A 31st fails with "PCI: no
/// slot/function available" (measured on QEMU 7.2).
pub const Q35_PCI_SLOTS: usize = 30;

impl Machine {
    /// How many virtio devices vmcsnap can attach to this machine.
    pub fn device_slots(self) -> usize {
        match self {
            Machine::Microvm => MICROVM_VIRTIO_SLOTS,
            Machine::Q35 => Q35_PCI_SLOTS,
        }
    }
}

/// QEMU machine type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Machine {
    /// `microvm`: virtio-mmio devices, no firmware that boots a disk (needs
    /// a kernel). The lab guest always runs on it.
    #[default]
    Microvm,
    /// `q35`: PCI devices, SeaBIOS boots the image's bootloader.
    Q35,
}

impl std::fmt::Display for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Machine::Microvm => "microvm",
            Machine::Q35 => "q35",
        })
    }
}

/// Format of a disk image file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    /// QEMU's copy-on-write format.
    Qcow2,
    /// A plain disk image.
    Raw,
}

impl DiskFormat {
    /// The QEMU block driver name.
    pub fn driver(self) -> &'static str {
        match self {
            DiskFormat::Qcow2 => "qcow2",
            DiskFormat::Raw => "raw",
        }
    }
}

/// One entry of a VM's `disks` list: either an existing image file (used
/// through an overlay, never written) or a fresh empty disk of a size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSpec {
    /// An existing disk image, the backing file of the VM's overlay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Format of `path`; absent: the agent detects it (`qemu-img info`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<DiskFormat>,
    /// Size of a fresh, empty qcow2 disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_mib: Option<u64>,
}

/// What a validated [`DiskSpec`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraDisk<'a> {
    /// An existing image used through an overlay (`format` `None`: detect).
    Image {
        /// The image.
        path: &'a Path,
        /// Its format, if the spec says.
        format: Option<DiskFormat>,
    },
    /// A fresh empty qcow2 disk.
    Empty {
        /// Its size.
        size_mib: u64,
    },
}

impl DiskSpec {
    /// The disk this entry describes (after validation exactly one of `path`
    /// and `size_mib` is set).
    pub fn kind(&self) -> ExtraDisk<'_> {
        match (&self.path, self.size_mib) {
            (Some(path), _) => ExtraDisk::Image {
                path,
                format: self.format,
            },
            (None, size) => ExtraDisk::Empty {
                size_mib: size.unwrap_or(0),
            },
        }
    }
}

/// `ssh_authorized_keys`: the keys themselves, or a file of keys (one per
/// line, as `~/.ssh/authorized_keys`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum SshKeys {
    /// `ssh_authorized_keys = ["ssh-ed25519 AAAA... me@host", ...]`.
    Keys(Vec<String>),
    /// `ssh_authorized_keys = "keys.pub"` (read by the agent).
    File(PathBuf),
}

impl<'de> Deserialize<'de> for SshKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = SshKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of public keys or the path of a file of keys")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<SshKeys, E> {
                Ok(SshKeys::File(PathBuf::from(v)))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<SshKeys, A::Error> {
                let mut keys = Vec::new();
                while let Some(k) = seq.next_element::<String>()? {
                    keys.push(k);
                }
                Ok(SshKeys::Keys(keys))
            }
        }
        d.deserialize_any(V)
    }
}

/// Where an image VM's root disk comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageSource<'a> {
    /// A file the user brings (`image`), with its format if the spec says.
    Path {
        /// The image.
        path: &'a Path,
        /// `image_format`; `None`: detect.
        format: Option<DiskFormat>,
    },
    /// An image `vmcsnap image build` makes (`image_recipe`); the agent
    /// checks the name.
    Recipe {
        /// `image_recipe`.
        name: &'a str,
        /// `image_suite` (default bookworm).
        suite: ImageSuite,
    },
}

/// `image_suite`: the Debian release a recipe image is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ImageSuite {
    /// Debian 12 (kernel 6.1).
    #[default]
    Bookworm,
    /// Debian 13 (kernel 6.12).
    Trixie,
}

/// How an image VM boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boot<'a> {
    /// Through the image's own bootloader (SeaBIOS + GRUB; q35 only).
    Firmware,
    /// Direct kernel boot.
    Direct {
        /// `-kernel`.
        kernel: &'a Path,
        /// `-initrd`, if any.
        initrd: Option<&'a Path>,
        /// `-append`, if any.
        cmdline: Option<&'a str>,
    },
}

/// An image VM with every default resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageGuest<'a> {
    /// The root disk.
    pub source: ImageSource<'a>,
    /// Machine type (default q35).
    pub machine: Machine,
    /// Boot path.
    pub boot: Boot<'a>,
    /// Extra disks, in order (`disk1`, `disk2`, ...).
    pub disks: Vec<ExtraDisk<'a>>,
    /// Whether the VM gets a NoCloud seed (default true).
    pub cloud_init: bool,
    /// Keys for the seed's `ssh_authorized_keys`.
    pub ssh_keys: Option<&'a SshKeys>,
}

/// What kind of guest a VM is (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestKind<'a> {
    /// vmcsnap's busybox lab guest on microvm.
    Lab,
    /// A user or recipe image.
    Image(ImageGuest<'a>),
}

/// `[cluster] host_access`: how the host reaches the VMs' network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum HostAccess {
    /// A network namespace of the cluster holds an interface on the
    /// switch; `ip netns exec` reaches the VMs. The host's own network is
    /// untouched.
    #[default]
    Netns,
    /// The host itself gets an interface on the cluster subnet.
    Host,
    /// The subnet stays inside the switch.
    None,
}
