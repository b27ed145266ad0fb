//! `--storage`: how a snapshot's memory image is stored, parsed once (the
//! CLI through clap, the agent from the request) by [`ImageStorage`]'s
//! `FromStr`. On the wire it is the same string the command line takes.
//!
//! ```text
//! storage   = layout [",no-disk"] | "no-disk"
//! layout    = "zstd" | "lz4" | "none" | "v1" | "lz4-random"
//! ```

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The memory image's layout and codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StorageLayout {
    /// Format 2, Zstandard-compressed locality blocks (the default).
    #[default]
    Zstd,
    /// Format 2, LZ4 (faster codec, larger image).
    Lz4,
    /// Format 2, uncompressed.
    None,
    /// Format 1.0, for older vmcsnap releases (no detection layer).
    V1,
    /// A benchmark control: LZ4 blocks of pages scattered at random over
    /// 256 open blocks, no locality (Halite's control).
    Lz4Random,
}

impl StorageLayout {
    /// Every layout, in the order `--help` lists them.
    pub const ALL: &'static [StorageLayout] = &[
        StorageLayout::Zstd,
        StorageLayout::Lz4,
        StorageLayout::None,
        StorageLayout::V1,
        StorageLayout::Lz4Random,
    ];

    /// The layout's name.
    pub fn name(self) -> &'static str {
        match self {
            StorageLayout::Zstd => "zstd",
            StorageLayout::Lz4 => "lz4",
            StorageLayout::None => "none",
            StorageLayout::V1 => "v1",
            StorageLayout::Lz4Random => "lz4-random",
        }
    }
}

/// The suffix (or whole value) that turns the detection layer off.
pub const NO_DISK: &str = "no-disk";

/// What `--storage` asks for: a layout, and whether pages that lie on the
/// frozen disk are stored as references to it (the detection layer; off
/// with `no-disk`, and always off for `v1`, which cannot store them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ImageStorage {
    /// Layout and codec.
    pub layout: StorageLayout,
    /// `no-disk` was given.
    pub no_disk: bool,
}

impl ImageStorage {
    /// Whether the detection layer is on.
    pub fn disk_layer(self) -> bool {
        !self.no_disk && self.layout != StorageLayout::V1
    }
}

impl std::str::FromStr for ImageStorage {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            let layouts: Vec<&str> = StorageLayout::ALL.iter().map(|l| l.name()).collect();
            format!(
                "unknown image storage {s:?}: use one of {}, optionally followed by \",{NO_DISK}\" (e.g. \"lz4,{NO_DISK}\"), or \"{NO_DISK}\" alone",
                layouts.join(", ")
            )
        };
        if s == NO_DISK {
            return Ok(ImageStorage {
                layout: StorageLayout::default(),
                no_disk: true,
            });
        }
        let (layout, no_disk) = match s.split_once(',') {
            Some((l, NO_DISK)) => (l, true),
            Some(_) => return Err(bad()),
            None => (s, false),
        };
        let layout = StorageLayout::ALL
            .iter()
            .copied()
            .find(|l| l.name() == layout)
            .ok_or_else(bad)?;
        Ok(ImageStorage { layout, no_disk })
    }
}

impl std::fmt::Display for ImageStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.layout.name())?;
        if self.no_disk {
            write!(f, ",{NO_DISK}")?;
        }
        Ok(())
    }
}

impl Serialize for ImageStorage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ImageStorage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> ImageStorage {
        s.parse().unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    #[test]
    fn every_form_parses() {
        use StorageLayout::*;
        for (s, layout, no_disk, disk_layer) in [
            ("zstd", Zstd, false, true),
            ("lz4", Lz4, false, true),
            ("none", None, false, true),
            ("v1", V1, false, false),
            ("lz4-random", Lz4Random, false, true),
            ("no-disk", Zstd, true, false),
            ("zstd,no-disk", Zstd, true, false),
            ("lz4,no-disk", Lz4, true, false),
            ("none,no-disk", None, true, false),
            ("lz4-random,no-disk", Lz4Random, true, false),
            ("v1,no-disk", V1, true, false),
        ] {
            let st = parse(s);
            assert_eq!(st, ImageStorage { layout, no_disk }, "{s}");
            assert_eq!(st.disk_layer(), disk_layer, "{s}");
        }
        assert_eq!(ImageStorage::default(), parse("zstd"));
        assert!(ImageStorage::default().disk_layer());
    }

    #[test]
    fn names_parse_back_and_travel_as_strings() {
        for &layout in StorageLayout::ALL {
            for no_disk in [false, true] {
                let st = ImageStorage { layout, no_disk };
                assert_eq!(parse(&st.to_string()), st);
                let wire = serde_json::to_value(st).unwrap();
                assert_eq!(wire, serde_json::json!(st.to_string()));
                assert_eq!(serde_json::from_value::<ImageStorage>(wire).unwrap(), st);
            }
        }
        assert_eq!(parse("no-disk").to_string(), "zstd,no-disk");
    }

    #[test]
    fn bad_input_gives_one_error_naming_the_forms() {
        let want = |s: &str| {
            format!(
                "unknown image storage {s:?}: use one of zstd, lz4, none, v1, lz4-random, optionally followed by \",no-disk\" (e.g. \"lz4,no-disk\"), or \"no-disk\" alone"
            )
        };
        for s in [
            "",
            "gzip",
            "LZ4",
            "lz4,",
            ",no-disk",
            "lz4,no-disk,no-disk",
            "lz4,disk",
            "no-disk,lz4",
            "zstd ",
        ] {
            assert_eq!(s.parse::<ImageStorage>().unwrap_err(), want(s), "{s:?}");
        }
        let e = serde_json::from_value::<ImageStorage>(serde_json::json!("gzip")).unwrap_err();
        assert!(
            e.to_string().contains("unknown image storage \"gzip\""),
            "{e}"
        );
    }
}
