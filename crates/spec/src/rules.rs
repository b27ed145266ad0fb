//! The rules of the image-VM fields, the resolution of their defaults
//! ([`VmSpec::kind`]) and of relative paths.
//!
//! Defaults: an image VM runs on q35 (its stock kernel boots there directly
//! or through GRUB); microvm only when asked for, and only with a `kernel`.
//! It gets a NoCloud seed unless `cloud_init = false`.

use std::path::Path;

use crate::guest::{Boot, GuestKind, ImageGuest, ImageSource, Machine, SshKeys};
use crate::model::{check_name, MAX_DISK_MIB, MIN_DISK_MIB};
use crate::{ClusterSpec, SpecError, VmSpec};

/// Longest recipe name.
const MAX_RECIPE_NAME: usize = 32;

impl VmSpec {
    /// Whether this VM boots an image (`image` or `image_recipe`) rather
    /// than the lab guest.
    pub fn is_image(&self) -> bool {
        self.image.is_some() || self.image_recipe.is_some()
    }

    /// The VM's kind with every default resolved. Call on a validated spec
    /// (on an invalid one the result is unspecified but does not panic).
    pub fn kind(&self) -> GuestKind<'_> {
        let source = match (&self.image, &self.image_recipe) {
            (Some(path), _) => ImageSource::Path {
                path,
                format: self.image_format,
            },
            (None, Some(recipe)) => ImageSource::Recipe {
                name: recipe,
                suite: self.image_suite.unwrap_or_default(),
            },
            (None, None) => return GuestKind::Lab,
        };
        let boot = match &self.kernel {
            Some(kernel) => Boot::Direct {
                kernel,
                initrd: self.initrd.as_deref(),
                cmdline: self.cmdline.as_deref(),
            },
            None => Boot::Firmware,
        };
        GuestKind::Image(ImageGuest {
            source,
            machine: self.machine.unwrap_or(Machine::Q35),
            boot,
            disks: self.disks.iter().map(|d| d.kind()).collect(),
            cloud_init: self.cloud_init.unwrap_or(true),
            ssh_keys: self.ssh_authorized_keys.as_ref(),
        })
    }

    /// The rules of the image-VM fields (see docs/cluster-spec.md).
    pub(crate) fn check_guest_fields(&self) -> Result<(), SpecError> {
        let vm = || self.name.clone();
        if self.image.is_some() && self.image_recipe.is_some() {
            return Err(SpecError::ImageAndRecipe(vm()));
        }
        if self.image_suite.is_some() && self.image_recipe.is_none() {
            return Err(SpecError::SuiteNeedsRecipe(vm()));
        }
        if !self.is_image() {
            let needs = |field| Err(SpecError::NeedsImage { vm: vm(), field });
            return match self {
                s if s.kernel.is_some() => needs("kernel"),
                s if s.initrd.is_some() => needs("initrd"),
                s if s.cmdline.is_some() => needs("cmdline"),
                s if s.image_format.is_some() => needs("image_format"),
                s if !s.disks.is_empty() => needs("disks"),
                s if s.machine == Some(Machine::Q35) => needs("machine = \"q35\""),
                s if s.cloud_init == Some(true) => needs("cloud_init = true"),
                s if s.ssh_authorized_keys.is_some() => needs("ssh_authorized_keys"),
                _ => Ok(()),
            };
        }
        if self.image_format.is_some() && self.image.is_none() {
            return Err(SpecError::NeedsImage {
                vm: vm(),
                field: "image_format (with image)",
            });
        }
        for (field, path) in [
            ("image", &self.image),
            ("kernel", &self.kernel),
            ("initrd", &self.initrd),
        ] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                return Err(SpecError::EmptyPath { vm: vm(), field });
            }
        }
        if let Some(recipe) = &self.image_recipe {
            check_name("image_recipe", recipe, MAX_RECIPE_NAME)?;
        }
        if self.kernel.is_none() {
            if self.initrd.is_some() {
                return Err(SpecError::NeedsKernel {
                    vm: vm(),
                    field: "initrd",
                });
            }
            if self.cmdline.is_some() {
                return Err(SpecError::NeedsKernel {
                    vm: vm(),
                    field: "cmdline",
                });
            }
            // A recipe image boots with its own kernel (it has no bootloader).
            if self.machine == Some(Machine::Microvm) && self.image_recipe.is_none() {
                return Err(SpecError::MicrovmNeedsKernel(vm()));
            }
        }
        let cloud_init = self.cloud_init.unwrap_or(true);
        match &self.ssh_authorized_keys {
            Some(_) if !cloud_init => return Err(SpecError::KeysNeedCloudInit(vm())),
            Some(SshKeys::Keys(keys)) => {
                for (i, k) in keys.iter().enumerate() {
                    if let Err(why) = crate::ssh_key::check_public_key(k) {
                        return Err(SpecError::BadSshKeys {
                            vm: vm(),
                            reason: format!("entry {i} ({k:?}): {why}"),
                        });
                    }
                }
            }
            Some(SshKeys::File(p)) if p.as_os_str().is_empty() => {
                return Err(SpecError::EmptyPath {
                    vm: vm(),
                    field: "ssh_authorized_keys",
                })
            }
            _ => {}
        }
        for (index, d) in self.disks.iter().enumerate() {
            let bad = |reason: String| {
                Err(SpecError::BadDisk {
                    vm: vm(),
                    index,
                    reason,
                })
            };
            match (&d.path, d.size_mib) {
                (Some(_), Some(_)) => return bad("set path or size_mib, not both".into()),
                (None, None) => return bad("set path = \"IMAGE\" or size_mib = N".into()),
                (Some(p), None) if p.as_os_str().is_empty() => return bad("empty path".into()),
                (None, Some(_)) if d.format.is_some() => {
                    return bad(
                        "format applies to path only (a size_mib disk is a fresh qcow2)".into(),
                    )
                }
                (None, Some(n)) if !(MIN_DISK_MIB..=MAX_DISK_MIB).contains(&n) => {
                    return bad(format!("size_mib = {n} is out of range (8-1048576)"))
                }
                _ => {}
            }
        }
        // NIC + virtio-serial + root + seed + extra disks, one virtio
        // device each (crate `vmcsnap-agent`, `qemu::QemuConfig::args`).
        let machine = self.machine.unwrap_or(Machine::Q35);
        let got = 3 + usize::from(cloud_init) + self.disks.len();
        let max = machine.device_slots();
        if got > max {
            return Err(SpecError::TooManyDevices {
                vm: vm(),
                machine,
                got,
                max,
                max_disks: max - 3 - usize::from(cloud_init),
            });
        }
        Ok(())
    }
}

impl ClusterSpec {
    /// Makes every relative path of the spec (`image`, `kernel`, `initrd`,
    /// `disks[].path`, a keys file) relative to `base`, the directory of the
    /// spec file. Call it where the spec file's path is known (the CLI).
    pub fn resolve_relative_paths(&mut self, base: &Path) {
        let fix = |p: &mut std::path::PathBuf| {
            if p.is_relative() && !p.as_os_str().is_empty() {
                *p = base.join(&*p);
            }
        };
        for vm in &mut self.vm {
            let keys = match &mut vm.ssh_authorized_keys {
                Some(SshKeys::File(p)) => Some(p),
                _ => None,
            };
            let disks = vm.disks.iter_mut().filter_map(|d| d.path.as_mut());
            for p in [
                vm.image.as_mut(),
                vm.kernel.as_mut(),
                vm.initrd.as_mut(),
                keys,
            ]
            .into_iter()
            .flatten()
            .chain(disks)
            {
                fix(p);
            }
        }
    }
}
