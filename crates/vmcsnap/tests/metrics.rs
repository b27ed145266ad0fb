//! The agent's metrics endpoint (`--metrics-listen`, here through
//! `VMCSNAP_METRICS_LISTEN` for the agent the CLI starts on demand): a hot
//! snapshot of a real VM shows up in the pause histogram and the snapshot
//! bytes, scraped over loopback, and the whole text parses as OpenMetrics.
//! The same agent logs JSON (`VMCSNAP_LOG_FORMAT=json`), its snapshot's
//! lines inside a span with the operation, the VM and the snapshot.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};

use common::{cluster_lock, Env};

const SPEC: &str = r#"
[cluster]
name = "mt"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 192
workload = """
memtouch -m 8 -r 0 &
"""
"#;

/// GET /metrics; the body, after checking the status line.
fn scrape(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("the metrics endpoint listens");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP reply");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("application/openmetrics-text"), "{head}");
    body.to_string()
}

/// Parses the OpenMetrics text: `# HELP`/`# TYPE`/`# UNIT` lines, samples
/// `name{label="value",...} number`, and a final `# EOF`. Returns the
/// samples by their series (name and labels as written). Panics on a line
/// that is none of these, a sample whose family has no TYPE, or a value
/// that is no number.
fn parse(text: &str) -> BTreeMap<String, f64> {
    let mut lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.pop(), Some("# EOF"), "the text ends with # EOF");
    let mut typed: Vec<String> = Vec::new();
    let mut samples = BTreeMap::new();
    for line in lines {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            assert!(
                ["counter", "histogram", "gauge", "summary", "unknown"].contains(&kind),
                "{line}"
            );
            typed.push(name.to_string());
            continue;
        }
        if line.starts_with("# HELP ") || line.starts_with("# UNIT ") {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
        let name = series.split('{').next().unwrap();
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "{line}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            if !labels.is_empty() {
                let inner = labels.strip_prefix('{').and_then(|l| l.strip_suffix('}'));
                let inner = inner.unwrap_or_else(|| panic!("labels of {line}"));
                for pair in inner.split(',') {
                    let (k, v) = pair.split_once('=').unwrap_or_else(|| panic!("{line}"));
                    assert!(
                        !k.is_empty() && v.starts_with('"') && v.ends_with('"'),
                        "{line}"
                    );
                }
            }
        }
        assert!(
            typed.iter().any(|t| name.starts_with(t.as_str())),
            "{name} has no # TYPE before it"
        );
        let v: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|e| panic!("{line}: {e}")),
        };
        samples.insert(series.to_string(), v);
    }
    samples
}

#[test]
fn a_snapshot_is_counted_in_the_scraped_pause_histogram() {
    let _l = cluster_lock();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut env = Env::new();
    env.extra_env
        .push(("VMCSNAP_METRICS_LISTEN".into(), format!("127.0.0.1:{port}")));
    env.extra_env
        .push(("VMCSNAP_LOG_FORMAT".into(), "json".into()));
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    let pause = r#"vmcsnap_snapshot_pause_seconds_count{vm="a"}"#;
    let bytes = r#"vmcsnap_snapshot_bytes_total{vm="a"}"#;
    let before = parse(&scrape(port));
    assert_eq!(before.get(pause), None, "no snapshot yet: {before:?}");

    let r = env.json(&["snapshot", "a", "--mode", "hot", "--name", "m1", "--json"]);
    let after = parse(&scrape(port));
    assert_eq!(after.get(pause), Some(&1.0), "{after:?}");
    let sum = after[r#"vmcsnap_snapshot_pause_seconds_sum{vm="a"}"#];
    let downtime = r["downtime_ms"].as_f64().unwrap() / 1000.0;
    assert!((sum - downtime).abs() < 1e-6, "{sum} vs {downtime}");
    let pages = r["pages_stored"].as_u64().unwrap();
    assert_eq!(
        after.get(bytes),
        Some(&((pages * 4096) as f64)),
        "{after:?}"
    );

    env.ok(&["snapshot", "a", "--mode", "hot", "--name", "m2"]);
    let again = parse(&scrape(port));
    assert_eq!(again.get(pause), Some(&2.0), "{again:?}");
    env.ok(&["down"]);

    // The agent's log lines are JSON objects (other lines there are what
    // child processes wrote); the snapshot's are in its span.
    let log = std::fs::read_to_string(env.run_dir().join("agent.log")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(lines.len() > 3, "{log}");
    assert!(
        lines.iter().all(|l| l["fields"]["message"].is_string()),
        "{log}"
    );
    let in_span = lines.iter().find(|l| {
        l["span"]["operation"] == "snapshot"
            && l["span"]["vm"] == "a"
            && l["span"]["snapshot"]
                .as_str()
                .is_some_and(|s| s.contains("m1"))
    });
    assert!(
        in_span.is_some(),
        "no line of the snapshot m1 in its span: {log}"
    );
}
