//! The measurements a VM snapshot's manifest records beyond the image
//! crate's own fields (its `metrics`' open part, `Metrics::other`), as
//! read back by a restore and `vmcsnap inspect`: one type, not string
//! keys at each reader. Written by the capture (`stream_bytes`) and the
//! agent (the rest); [`SnapshotMetrics::record`] is the agent's writer.
//! Lenient like [`ClusterSnapshotMetrics`](super::cluster_manifest::ClusterSnapshotMetrics):
//! a field absent or in another layout reads as `None`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The manifest `metrics` keys read back. `None` fields are not written.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SnapshotMetrics {
    /// Where the restore's access data comes from: `damon` (being or
    /// collected into `access/accessed.json`) or `none: <why>`.
    #[serde(
        default,
        deserialize_with = "lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub access_data: Option<String>,
    /// The parent of an incremental snapshot, or `none: <why>` it is full.
    #[serde(
        default,
        deserialize_with = "lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub parent: Option<String>,
    /// Bytes of QEMU's migration stream (the capture's).
    #[serde(
        default,
        deserialize_with = "lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub stream_bytes: Option<u64>,
    /// HotRestore's WSS_sample: the sampler's mean pages touched.
    #[serde(
        default,
        deserialize_with = "lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub wss_sample_pages: Option<u64>,
    /// Of the sampler's samples, the mean pages written.
    #[serde(
        default,
        deserialize_with = "lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub wss_sample_written_pages: Option<u64>,
    /// Samples behind `wss_sample_pages`.
    #[serde(
        default,
        deserialize_with = "lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub wss_samples: Option<u64>,
    /// Pages the newest sample saw touched just before the snapshot point.
    #[serde(
        default,
        deserialize_with = "lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub wss_snapshot_touched_pages: Option<u64>,
}

impl SnapshotMetrics {
    /// Reads the keys from a manifest's open metrics.
    pub fn read(other: &BTreeMap<String, Value>) -> Self {
        let map: serde_json::Map<String, Value> =
            other.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        Self::deserialize(Value::Object(map)).unwrap_or_default()
    }

    /// Writes the `Some` fields into a manifest's open metrics, replacing
    /// what is there under their keys.
    pub fn record(&self, other: &mut BTreeMap<String, Value>) {
        if let Ok(Value::Object(m)) = serde_json::to_value(self) {
            other.extend(m);
        }
    }
}

fn from<T: serde::de::DeserializeOwned>(v: Value) -> Option<T> {
    serde_json::from_value(v).ok()
}

fn lenient<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    Ok(from(Value::deserialize(d)?))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn reads_what_it_records_and_only_what_it_knows() {
        let m = SnapshotMetrics {
            access_data: Some("none: DAMON absent".into()),
            parent: Some("a-1".into()),
            stream_bytes: Some(74_000_000),
            wss_sample_pages: Some(900),
            wss_sample_written_pages: Some(85),
            wss_samples: Some(3),
            wss_snapshot_touched_pages: Some(1400),
        };
        let mut other = BTreeMap::new();
        other.insert("capture_ms".to_string(), json!(12));
        other.insert("parent".to_string(), json!("stale"));
        m.record(&mut other);
        assert_eq!(other["parent"], json!("a-1"));
        assert_eq!(other["stream_bytes"], json!(74_000_000));
        assert_eq!(other["capture_ms"], json!(12));
        assert_eq!(SnapshotMetrics::read(&other), m);
        // `None` is not written.
        let mut none = BTreeMap::new();
        SnapshotMetrics::default().record(&mut none);
        assert!(none.is_empty());
        // A key in another layout reads as absent, the rest still read.
        other.insert("stream_bytes".to_string(), json!("many"));
        let r = SnapshotMetrics::read(&other);
        assert_eq!((r.stream_bytes, r.wss_samples), (None, Some(3)));
    }
}
