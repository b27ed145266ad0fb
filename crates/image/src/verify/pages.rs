//! The per-page pass of [`Image::verify`]: every page resolved through the
//! chain as a restore resolves it, checked against this image's CRC, and
//! its hash (`hashes.bin`) against its bytes.

use std::path::Path;

use super::{BadBlock, VerifyReport};
use crate::error::ReadError;
use crate::format::PageKey;
use crate::hashes::page_hash;
use crate::reader::{Image, PageState};

/// A page of this image whose bytes are in a block of a parent.
struct FromParent {
    /// Parents between this image and the holder, plus one.
    depth: usize,
    block: u32,
    slot: u16,
    key: PageKey,
    /// This image's CRC of the page.
    crc: u32,
}

impl Image {
    /// Checks every page that is not one of this image's stored pages (those
    /// were checked with their blocks) and every page's hash.
    pub(super) fn verify_pages(
        &self,
        report: &mut VerifyReport,
        hashes: Option<&[Vec<u128>]>,
        slot_hashes: &[Option<Vec<u128>>],
    ) {
        let ps = self.page_size();
        let zero_crc = crc32c::crc32c(&vec![0u8; ps]);
        let mut buf = vec![0u8; ps];
        let mut from_parent = Vec::new();
        for r in 0..self.ram_blocks().len() as u32 {
            for p in 0..self.ram_block_pages(r) {
                let key = PageKey::new(r, p);
                let state = match self.locate(key) {
                    Ok(s) => s,
                    Err(e) => {
                        report.bad_page(key, e);
                        continue;
                    }
                };
                let actual = match state {
                    // Checked with its block; unknown if the block is bad.
                    PageState::Stored(loc) => slot_hashes
                        .get(loc.block as usize)
                        .and_then(Option::as_ref)
                        .and_then(|h| h.get(usize::from(loc.slot)).copied()),
                    PageState::Zero => Some(0),
                    PageState::Absent => {
                        report.bad_page(key, absent(self.dir(), key));
                        continue;
                    }
                    PageState::OnDisk { .. } => match self.read_page(key, &mut buf) {
                        Ok(_) => {
                            report.pages_checked += 1;
                            report.disk_pages_checked += 1;
                            report.bytes_read += ps as u64;
                            Some(page_hash(&buf))
                        }
                        Err(e) => {
                            report.bad_page(key, e);
                            continue;
                        }
                    },
                    PageState::InParent { crc } => match self.resolve_depth(key) {
                        Ok((depth, _, PageState::Stored(loc))) => {
                            from_parent.push(FromParent {
                                depth,
                                block: loc.block,
                                slot: loc.slot,
                                key,
                                crc,
                            });
                            continue;
                        }
                        Ok((_, holder, st)) => {
                            match self
                                .parent_page_elsewhere(holder, st, key, crc, zero_crc, &mut buf)
                            {
                                Ok(h) => {
                                    report.pages_checked += 1;
                                    report.parent_pages_checked += 1;
                                    report.disk_pages_checked +=
                                        u64::from(matches!(st, PageState::OnDisk { .. }));
                                    Some(h)
                                }
                                Err(e) => {
                                    report.bad_page(key, e);
                                    continue;
                                }
                            }
                        }
                        Err(e) => {
                            report.bad_page(key, e);
                            continue;
                        }
                    },
                };
                self.check_hash(report, hashes, key, actual);
            }
        }
        self.verify_parent_blocks(report, hashes, from_parent);
    }

    /// An in-parent page whose holder does not store it in a block: its
    /// hash, once its bytes match this image's CRC `crc`.
    fn parent_page_elsewhere(
        &self,
        holder: &Image,
        st: PageState,
        key: PageKey,
        crc: u32,
        zero_crc: u32,
        buf: &mut [u8],
    ) -> Result<u128, ReadError> {
        let hash = match st {
            PageState::Zero => {
                buf.fill(0);
                0
            }
            PageState::OnDisk { .. } => {
                holder.read_page(key, buf)?;
                page_hash(buf)
            }
            _ => return Err(absent(holder.dir(), key)),
        };
        let found = if matches!(st, PageState::Zero) {
            zero_crc
        } else {
            crc32c::crc32c(buf)
        };
        if found != crc {
            return Err(self.parent_crc_error(holder, key, None, 0));
        }
        Ok(hash)
    }

    /// Reads each parent block holding pages of this image once, and checks
    /// those pages against this image's CRCs and hashes.
    fn verify_parent_blocks(
        &self,
        report: &mut VerifyReport,
        hashes: Option<&[Vec<u128>]>,
        mut pages: Vec<FromParent>,
    ) {
        pages.sort_unstable_by_key(|f| (f.depth, f.block, f.slot));
        for group in pages.chunk_by(|a, b| (a.depth, a.block) == (b.depth, b.block)) {
            let (depth, b) = (group[0].depth, group[0].block);
            let Some(holder) = self.chain_image(depth) else {
                continue;
            };
            let info = holder.blocks()[b as usize];
            report.blocks_checked += 1;
            report.bytes_read += u64::from(info.stored_len);
            let block = match holder.read_block(b) {
                Ok(block) => block,
                Err(error) => {
                    report.bad_blocks.push(BadBlock {
                        image: holder.dir().into(),
                        index: b,
                        offset: info.offset,
                        error,
                    });
                    continue;
                }
            };
            for f in group {
                let bytes = block.page(usize::from(f.slot));
                report.pages_checked += 1;
                report.parent_pages_checked += 1;
                if crc32c::crc32c(bytes) != f.crc {
                    let e = self.parent_crc_error(holder, f.key, Some(b), info.offset);
                    report.bad_page(f.key, e);
                    continue;
                }
                self.check_hash(report, hashes, f.key, Some(page_hash(bytes)));
            }
        }
    }

    /// Compares page `key`'s hash in `hashes.bin` with `actual`, the hash
    /// of its bytes (if they could be read).
    fn check_hash(
        &self,
        report: &mut VerifyReport,
        hashes: Option<&[Vec<u128>]>,
        key: PageKey,
        actual: Option<u128>,
    ) {
        let (Some(h), Some(actual)) = (hashes, actual) else {
            return;
        };
        let Some(&recorded) = h
            .get(key.ram_block as usize)
            .and_then(|v| v.get(key.page as usize))
        else {
            return;
        };
        report.hashes_checked += 1;
        if recorded != actual {
            let file = self
                .hashes_file
                .as_ref()
                .map_or_else(|| self.dir().to_path_buf(), |(p, _, _)| p.clone());
            report.bad_page(
                key,
                ReadError::corrupt(
                    file,
                    "its hash is not the hash of its bytes: a snapshot incremental to this one \
                     would leave pages out wrongly and fail to restore; take the next snapshot \
                     of this VM with --full",
                ),
            );
        }
    }

    /// The error for a page of a parent whose bytes do not have this
    /// image's CRC.
    fn parent_crc_error(
        &self,
        holder: &Image,
        key: PageKey,
        block: Option<u32>,
        offset: u64,
    ) -> ReadError {
        ReadError::BadCrc {
            file: holder.dir().into(),
            what: format!(
                "page {}:{} read from the parent snapshot for {} (it has another CRC)",
                key.ram_block,
                key.page,
                self.dir().display()
            ),
            block,
            offset,
        }
    }

    /// [`Image::resolve`], with the number of parents walked.
    fn resolve_depth(&self, key: PageKey) -> Result<(usize, &Image, PageState), ReadError> {
        let mut img = self;
        let mut depth = 0;
        loop {
            match img.locate(key)? {
                PageState::InParent { .. } => {
                    img = img.parent().ok_or_else(|| {
                        ReadError::corrupt(
                            img.dir(),
                            "a page is in the parent, but no parent is open",
                        )
                    })?;
                    depth += 1;
                }
                st => return Ok((depth, img, st)),
            }
        }
    }

    /// The image `depth` parents up the chain (0 = this one).
    fn chain_image(&self, depth: usize) -> Option<&Image> {
        let mut img = self;
        for _ in 0..depth {
            img = img.parent()?;
        }
        Some(img)
    }
}

fn absent(dir: &Path, key: PageKey) -> ReadError {
    ReadError::NotFound(format!(
        "page {}:{} is absent from {} (neither stored, zero, on a frozen disk nor in a parent): \
         a restore cannot send it",
        key.ram_block,
        key.page,
        dir.display()
    ))
}
