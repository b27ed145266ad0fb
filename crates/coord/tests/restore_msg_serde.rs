//! Every restore message survives JSON (lines), alone and in an envelope;
//! so do the dependencies.

use vmcsnap_coord::restore::{Msg, Policy};
use vmcsnap_coord::transport::Envelope;

fn all() -> Vec<Msg> {
    vec![
        Msg::Load { epoch: 1 },
        Msg::LoadFin { epoch: 2 },
        Msg::Start { epoch: 3 },
        Msg::StartFin {
            epoch: 4,
            started_unix_us: 1_700_000_000_123_456,
        },
        Msg::StartAck { epoch: 5 },
        Msg::RestoreFin { epoch: 6 },
        Msg::AllRestoreFin { epoch: u64::MAX },
        Msg::Failed {
            epoch: 8,
            error: "page \"17\"\nunreadable ✓".into(),
        },
        Msg::Abort {
            epoch: 9,
            reason: String::new(),
        },
    ]
}

#[test]
fn every_variant_round_trips_as_a_json_line() {
    let mut names = Vec::new();
    for m in all() {
        let line = m.to_json_line();
        assert!(
            line.ends_with('\n') && !line[..line.len() - 1].contains('\n'),
            "{line:?}"
        );
        assert!(
            line.contains(&format!("\"type\":\"{}\"", m.name())),
            "{line}"
        );
        assert_eq!(Msg::from_json_line(&line).unwrap(), m);
        names.push(m.name());
    }
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 9);
}

#[test]
fn envelopes_round_trip() {
    for m in all() {
        let e = Envelope {
            from: "mgr".to_string(),
            to: "vm-1".to_string(),
            msg: m,
        };
        let s = serde_json::to_string(&e).unwrap();
        let back: Envelope<Msg> = serde_json::from_str(&s).unwrap();
        assert_eq!(back, e);
    }
}

#[test]
fn wire_form_is_stable() {
    assert_eq!(
        serde_json::to_value(Msg::StartFin {
            epoch: 9,
            started_unix_us: 5
        })
        .unwrap(),
        serde_json::json!({"type": "START_FIN", "epoch": 9, "started_unix_us": 5})
    );
    let m = Msg::from_json_line(r#"{"epoch":5,"type":"LOAD_FIN"}"#).unwrap();
    assert_eq!(m, Msg::LoadFin { epoch: 5 });
    assert_eq!(
        Msg::Load { epoch: 1 }.to_json_line(),
        "{\"type\":\"LOAD\",\"epoch\":1}\n"
    );
    // A snapshot message is not a restore message.
    assert!(Msg::from_json_line(r#"{"type":"SNAPSHOT","epoch":1}"#).is_err());
}

#[test]
fn policy_round_trips() {
    for p in [Policy::RestoreLine, Policy::Independent] {
        let s = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<Policy>(&s).unwrap(), p);
    }
}
