//! Reading a scheme's `tried_regions` and turning accessed regions into
//! guest-RAM page numbers.

use std::fs;
use std::path::{Path, PathBuf};

use crate::DamonError;

/// One region listed under `schemes/<S>/tried_regions/<R>/`: a range of the
/// target's virtual addresses and what DAMON saw of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// First address (inclusive).
    pub start: u64,
    /// End address (exclusive).
    pub end: u64,
    /// Samples of the last aggregation interval that saw an access.
    pub nr_accesses: u64,
    /// Aggregation intervals the access pattern has stayed about the same.
    pub age: u64,
}

impl Region {
    /// A region `[start, end)` seen accessed in `nr_accesses` samples, of
    /// age 0.
    pub const fn new(start: u64, end: u64, nr_accesses: u64) -> Self {
        Region {
            start,
            end,
            nr_accesses,
            age: 0,
        }
    }
}

/// Parses the content of one numeric sysfs file (`"123\n"`): ASCII decimal,
/// surrounding whitespace ignored. Total over any bytes (fuzz target).
pub fn parse_value(content: &[u8]) -> Result<u64, String> {
    let text = std::str::from_utf8(content).map_err(|_| "not UTF-8".to_string())?;
    let t = text.trim();
    let shown: String = t.chars().take(40).collect();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{shown:?} is not a decimal number"));
    }
    t.parse()
        .map_err(|_| format!("{shown:?} does not fit in 64 bits"))
}

/// Parses one region from the contents of its four files. Total over any
/// bytes (fuzz target); the error names the file.
pub fn parse_region(
    start: &[u8],
    end: &[u8],
    nr_accesses: &[u8],
    age: &[u8],
) -> Result<Region, (&'static str, String)> {
    let field = |name: &'static str, c: &[u8]| parse_value(c).map_err(|e| (name, e));
    let region = Region {
        start: field("start", start)?,
        end: field("end", end)?,
        nr_accesses: field("nr_accesses", nr_accesses)?,
        age: field("age", age)?,
    };
    if region.end < region.start {
        return Err((
            "end",
            format!("end {:#x} is before start {:#x}", region.end, region.start),
        ));
    }
    Ok(region)
}

/// The `tried_regions` directory of a scheme, under the admin root.
pub fn tried_regions_dir(root: &Path, kdamond: u32, context: u32, scheme: u32) -> PathBuf {
    root.join(format!(
        "kdamonds/{kdamond}/contexts/{context}/schemes/{scheme}/tried_regions"
    ))
}

/// Reads every region of a scheme's `tried_regions` directory, sorted by
/// start. Entries whose name is not a number (`total_bytes` in newer
/// kernels) are skipped. The directory holds what the last
/// `update_schemes_tried_regions` command put there ([`crate::plan_refresh`]);
/// it is empty before the first.
pub fn read_tried_regions(
    root: &Path,
    kdamond: u32,
    context: u32,
    scheme: u32,
) -> Result<Vec<Region>, DamonError> {
    let dir = tried_regions_dir(root, kdamond, context, scheme);
    let read_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DamonError::Read { path, source }
    };
    let mut regions = Vec::new();
    for entry in fs::read_dir(&dir).map_err(read_err(&dir))? {
        let entry = entry.map_err(read_err(&dir))?;
        let name = entry.file_name();
        if name.to_str().and_then(|n| n.parse::<u64>().ok()).is_none() {
            continue;
        }
        let rdir = entry.path();
        let mut contents: [Vec<u8>; 4] = Default::default();
        for (slot, file) in contents
            .iter_mut()
            .zip(["start", "end", "nr_accesses", "age"])
        {
            let path = rdir.join(file);
            *slot = fs::read(&path).map_err(read_err(&path))?;
        }
        let [s, e, n, a] = &contents;
        let region = parse_region(s, e, n, a).map_err(|(file, reason)| DamonError::Malformed {
            path: rdir.join(file),
            reason,
        })?;
        regions.push(region);
    }
    regions.sort_by_key(|r| (r.start, r.end));
    Ok(regions)
}

/// The pages of a mapping (numbers relative to its start: byte offset /
/// `page_size`, as in a RAM block's page keys) covered by regions with
/// `nr_accesses > 0`, clipped to `[mapping_start, mapping_start +
/// mapping_len)`. A page partly covered counts. Returned in order of
/// region start, hence ascending and without duplicates.
///
/// One read of `tried_regions` only says which regions were accessed in
/// the last aggregation interval, not in which order pages were first
/// touched: to get a first-detection order, the caller reads repeatedly
/// (each aggregation interval) and appends the pages not seen before.
/// A `page_size` of 0 gives no pages.
pub fn accessed_pages(
    regions: &[Region],
    mapping_start: u64,
    mapping_len: u64,
    page_size: u64,
) -> Vec<u64> {
    let mut pages = Vec::new();
    if page_size == 0 {
        return pages;
    }
    let map_end = mapping_start.saturating_add(mapping_len);
    let mut sorted: Vec<&Region> = regions.iter().filter(|r| r.nr_accesses > 0).collect();
    sorted.sort_by_key(|r| (r.start, r.end));
    // First page not yet emitted.
    let mut next = 0u64;
    for r in sorted {
        let lo = r.start.max(mapping_start);
        let hi = r.end.min(map_end);
        if lo >= hi {
            continue;
        }
        let first = ((lo - mapping_start) / page_size).max(next);
        let end = (hi - mapping_start).div_ceil(page_size);
        pages.extend(first..end);
        next = next.max(end);
    }
    pages
}
