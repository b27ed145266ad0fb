//! Which Debian archive to build images from: the host's own apt
//! configuration, so that an image uses the same mirror (or proxy, or
//! snapshot) as the host, and no host name is baked into vmcsnap.
//!
//! `$VMCSNAP_DEBIAN_MIRROR` wins; otherwise the first `deb` entry for the
//! suite `bookworm` with the component `main` in `/etc/apt/sources.list`,
//! `/etc/apt/sources.list.d/*.list` (one-line format) or
//! `/etc/apt/sources.list.d/*.sources` (deb822), in that order (files of a
//! directory sorted by name, other extensions ignored, as apt does).

use std::fs;
use std::path::{Path, PathBuf};

use super::ImageError;

/// Environment variable that overrides the mirror taken from apt's sources.
pub const MIRROR_ENV: &str = "VMCSNAP_DEBIAN_MIRROR";

const SUITE: &str = "bookworm";

/// The Debian mirror URI to build from (see the module documentation).
pub fn debian_mirror() -> Result<String, ImageError> {
    if let Some(m) = std::env::var_os(MIRROR_ENV).filter(|v| !v.is_empty()) {
        return Ok(m.to_string_lossy().into_owned());
    }
    let etc = Path::new("/etc/apt");
    let mut files: Vec<PathBuf> = vec![etc.join("sources.list")];
    if let Ok(rd) = fs::read_dir(etc.join("sources.list.d")) {
        let mut more: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                matches!(
                    p.extension().and_then(|e| e.to_str()),
                    Some("list" | "sources")
                )
            })
            .collect();
        more.sort();
        files.extend(more);
    }
    let texts: Vec<(PathBuf, String)> = files
        .into_iter()
        .filter_map(|p| fs::read_to_string(&p).ok().map(|t| (p, t)))
        .collect();
    texts
        .iter()
        .find_map(|(p, t)| mirror_in(p, t))
        .ok_or(ImageError::NoMirror)
}

/// The bookworm/main URI in one apt sources file, judged by its name.
pub fn mirror_in(path: &Path, text: &str) -> Option<String> {
    if path.extension().and_then(|e| e.to_str()) == Some("sources") {
        mirror_in_deb822(text)
    } else {
        mirror_in_one_line(text)
    }
}

/// `deb [options] URI SUITE COMPONENT...` lines.
pub fn mirror_in_one_line(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let line = line.split('#').next().unwrap_or("").trim();
        let rest = line.strip_prefix("deb")?;
        if !rest.starts_with([' ', '\t']) {
            return None; // deb-src, or garbage
        }
        let mut rest = rest.trim_start();
        if let Some(opts) = rest.strip_prefix('[') {
            rest = opts.split_once(']')?.1.trim_start();
        }
        let mut words = rest.split_whitespace();
        let uri = words.next()?;
        let suite = words.next()?;
        let components: Vec<&str> = words.collect();
        (suite == SUITE && components.contains(&"main") && is_uri(uri))
            .then(|| uri.trim_end_matches('/').to_string())
    })
}

/// deb822 stanzas (`Types:`, `URIs:`, `Suites:`, `Components:`, `Enabled:`).
pub fn mirror_in_deb822(text: &str) -> Option<String> {
    let mut stanzas: Vec<Vec<(String, String)>> = vec![Vec::new()];
    for line in text.lines() {
        if line.trim().is_empty() {
            stanzas.push(Vec::new());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let cur = stanzas.last_mut().expect("never empty");
        if line.starts_with([' ', '\t']) {
            // Continuation of the previous field.
            if let Some((_, v)) = cur.last_mut() {
                v.push(' ');
                v.push_str(line.trim());
            }
            continue;
        }
        if let Some((k, v)) = line.split_once(':') {
            cur.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    stanzas.iter().find_map(|s| {
        let field = |name: &str| -> Vec<&str> {
            s.iter()
                .filter(|(k, _)| k == name)
                .flat_map(|(_, v)| v.split_whitespace())
                .collect()
        };
        let enabled = field("enabled")
            .first()
            .is_none_or(|v| !v.eq_ignore_ascii_case("no"));
        let ok = enabled
            && field("types").contains(&"deb")
            && field("suites").contains(&SUITE)
            && field("components").contains(&"main");
        if !ok {
            return None;
        }
        field("uris")
            .into_iter()
            .find(|u| is_uri(u))
            .map(|u| u.trim_end_matches('/').to_string())
    })
}

fn is_uri(s: &str) -> bool {
    ["http://", "https://", "file:/", "mirror+", "copy:/"]
        .iter()
        .any(|p| s.starts_with(p))
        && !s.contains(['"', '\'', '\\'])
}

#[cfg(test)]
mod tests {
    use super::*;

    // Made-up addresses: never a real mirror's name in this repository.
    const A: &str = "http://mirror-a.invalid/debian";
    const B: &str = "http://mirror-b.invalid/debian";

    #[test]
    fn one_line_format() {
        let text = format!(
            "# comment\n\
             deb-src {B} bookworm main\n\
             deb {B}-security bookworm-security main\n\
             deb [signed-by=/k.gpg arch=amd64] {A}/ bookworm contrib main # trailing\n\
             deb {B} bookworm main\n"
        );
        assert_eq!(mirror_in_one_line(&text).as_deref(), Some(A));
        assert_eq!(
            mirror_in_one_line(&format!("deb {A} bookworm contrib\n")),
            None
        );
        assert_eq!(mirror_in_one_line(&format!("deb {A} trixie main\n")), None);
    }

    #[test]
    fn deb822_format() {
        let text = format!(
            "Types: deb\nURIs: {B}-security\nSuites: bookworm-security\nComponents: main\n\n\
             Types: deb deb-src\nURIs: {B}\nSuites: bookworm\nComponents: main\nEnabled: no\n\n\
             # the one\n\
             Types: deb\nURIs: {A}\nSuites: bookworm\n  bookworm-updates\nComponents: main\n\
             Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        );
        assert_eq!(mirror_in_deb822(&text).as_deref(), Some(A));
        assert_eq!(mirror_in(Path::new("x.sources"), &text).as_deref(), Some(A));
        // The same text read as a .list file has no one-line entries.
        assert_eq!(mirror_in(Path::new("x.list"), &text), None);
    }

    #[test]
    fn malformed_input_finds_nothing_and_does_not_panic() {
        for text in [
            "",
            "deb",
            "deb ",
            "deb [unterminated http://x.invalid bookworm main",
            "deb bookworm main",
            "debhttp://x.invalid bookworm main",
            "deb not-a-uri bookworm main",
            "deb \"http://x.invalid\" bookworm main",
            "\u{0}\u{ff}garbage\n:::\n",
        ] {
            assert_eq!(mirror_in_one_line(text), None, "{text:?}");
            assert_eq!(mirror_in_deb822(text), None, "{text:?}");
        }
        for text in [
            "Types: deb\nURIs:\nSuites: bookworm\nComponents: main\n",
            "URIs: http://x.invalid\nSuites: bookworm\nComponents: main\n",
            " continuation first\nTypes deb\n",
            "Types: deb\nURIs: http://x.invalid\nSuites: bookworm\nComponents: main\nEnabled: no\n",
        ] {
            assert_eq!(mirror_in_deb822(text), None, "{text:?}");
        }
    }

    #[test]
    fn this_host_has_a_mirror() {
        // The image build depends on it; the check reads /etc/apt only.
        let m = debian_mirror().unwrap_or_else(|e| panic!("{e}"));
        assert!(is_uri(&m), "{m}");
    }
}
