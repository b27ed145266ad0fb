//! The firmware a restored VM runs: the one its snapshot recorded.
//!
//! QEMU migrates the firmware ROM (RAM block `pc.bios`) like guest RAM, and
//! refuses a stream whose block has another size than its own ("Size
//! mismatch: pc.bios"). Another QEMU version, or a distribution's other
//! firmware package, may ship a firmware file of another size: QEMU 7.2 on
//! Debian 12 gives microvm a 64 KiB `bios-microvm.bin`, Debian 13's
//! seabios a 128 KiB one. The snapshot holds the firmware's bytes (they
//! are restored page by page anyway), so the restored QEMU gets them as its
//! `-bios`: the block has the snapshot's size on every QEMU, and the guest
//! keeps the exact firmware it booted with.

use std::path::{Path, PathBuf};

use vmcsnap_image::Image;

/// The RAM block of the firmware (`-bios`) on x86 machines.
pub const FIRMWARE_BLOCK: &str = "pc.bios";

/// Errors writing the firmware file.
#[derive(Debug, thiserror::Error)]
pub enum FirmwareError {
    /// The image's firmware pages could not be read.
    #[error("reading the firmware (RAM block {FIRMWARE_BLOCK}) from the snapshot: {0}; `vmcsnap inspect NAME --verify` checks the image")]
    Read(String),
    /// The file could not be written.
    #[error("writing the snapshot's firmware to {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Writes the snapshot's firmware into `vm_dir` (`firmware.bin`) and
/// returns its path; `None` if the image has no firmware block (QEMU then
/// uses its own).
pub fn write_from_image(img: &Image, vm_dir: &Path) -> Result<Option<PathBuf>, FirmwareError> {
    let Some(id) = img.ram_block_id(FIRMWARE_BLOCK) else {
        return Ok(None);
    };
    let mut bytes = vec![0u8; img.ram_block_pages(id) as usize * img.page_size()];
    img.read_ram_block(id, &mut bytes)
        .map_err(|e| FirmwareError::Read(e.to_string()))?;
    let path = vm_dir.join("firmware.bin");
    std::fs::write(&path, &bytes).map_err(|source| FirmwareError::Write {
        path: path.clone(),
        source,
    })?;
    Ok(Some(path))
}
