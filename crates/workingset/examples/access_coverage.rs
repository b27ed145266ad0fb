//! How much of a guest buffer a snapshot's access data covers: the check
//! of `make test-nested` (scripts/test-nested.sh).
//!
//! ```text
//! access_coverage ACCESSED_JSON CONSOLE_LOG [MIN_PERCENT [MAX_PAGES]]
//! ```
//!
//! The buffer's guest page frames come from the `memtouch: pfns first=F
//! count=N` lines memtouch `-P` printed on the guest console (on microvm,
//! guest-physical page F is page F of RAM block 0); the accessed pages from
//! `access/accessed.json`. Prints one `coverage` line and exits 1 if the
//! covered share of the buffer is below MIN_PERCENT (default 90), or if the
//! file lists more than MAX_PAGES pages in all (a file that names all of
//! guest RAM covers any buffer and says nothing).

use std::collections::HashSet;
use std::process::ExitCode;

use vmcsnap_workingset::access::AccessedPages;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 || args.len() > 4 {
        eprintln!("usage: access_coverage ACCESSED_JSON CONSOLE_LOG [MIN_PERCENT [MAX_PAGES]]");
        return ExitCode::from(2);
    }
    let min: f64 = match args.get(2).map(|s| s.parse()) {
        None => 90.0,
        Some(Ok(v)) => v,
        Some(Err(e)) => {
            eprintln!("access_coverage: MIN_PERCENT {:?}: {e}", args[2]);
            return ExitCode::from(2);
        }
    };
    let max_pages: u64 = match args.get(3).map(|s| s.parse()) {
        None => u64::MAX,
        Some(Ok(v)) => v,
        Some(Err(e)) => {
            eprintln!("access_coverage: MAX_PAGES {:?}: {e}", args[3]);
            return ExitCode::from(2);
        }
    };
    let read = |p: &str| std::fs::read(p).map_err(|e| format!("{p}: {e}"));
    let (json, console) = match (read(&args[0]), read(&args[1])) {
        (Ok(j), Ok(c)) => (j, String::from_utf8_lossy(&c).into_owned()),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("access_coverage: {e}");
            return ExitCode::from(2);
        }
    };
    // Block bounds are not known here: accept any run within u32 pages.
    let accessed = match AccessedPages::parse(&json, &[u32::MAX; 8]) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("access_coverage: {e}");
            return ExitCode::from(2);
        }
    };
    let mut buffer: HashSet<u64> = HashSet::new();
    for line in console.lines() {
        let Some(rest) = line.trim().strip_prefix("memtouch: pfns first=") else {
            continue;
        };
        let mut it = rest.split(" count=");
        let (Some(Ok(first)), Some(Ok(count))) = (
            it.next().map(str::parse::<u64>),
            it.next().map(|s| s.trim().parse::<u64>()),
        ) else {
            continue;
        };
        buffer.extend(first..first + count);
    }
    if buffer.is_empty() {
        eprintln!("access_coverage: no `memtouch: pfns` lines in {}", args[1]);
        return ExitCode::from(2);
    }
    let mut first_seen: Vec<(u32, u64)> = Vec::new();
    let mut covered: HashSet<u64> = HashSet::new();
    let mut total = 0u64;
    for r in accessed.runs.iter().filter(|r| r.ram_block == 0) {
        total += u64::from(r.pages);
        let before = covered.len();
        covered.extend(
            (u64::from(r.first_page)..u64::from(r.first_page) + u64::from(r.pages))
                .filter(|p| buffer.contains(p)),
        );
        first_seen.push((r.first_seen_ms, (covered.len() - before) as u64));
    }
    let pct = 100.0 * covered.len() as f64 / buffer.len() as f64;
    // When 90% of the buffer had been seen.
    let mut acc = 0u64;
    let at90 = first_seen.iter().find_map(|&(ms, n)| {
        acc += n;
        (acc * 10 >= buffer.len() as u64 * 9).then_some(ms)
    });
    println!(
        "coverage {pct:.1}% of the buffer ({} of {} pages); {} accessed pages in {} runs \
         (precision {:.1}%); 90% seen at {} ms",
        covered.len(),
        buffer.len(),
        total,
        accessed.runs.len(),
        100.0 * covered.len() as f64 / total.max(1) as f64,
        at90.map_or("never".to_string(), |m| m.to_string()),
    );
    if pct < min {
        eprintln!("access_coverage: {pct:.1}% < {min}%");
        return ExitCode::from(1);
    }
    if total > max_pages {
        eprintln!("access_coverage: {total} accessed pages > {max_pages}: not a working set");
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
