//! Every message survives JSON (lines), alone and in an envelope.

use vmcsnap_coord::snapshot::Msg;
use vmcsnap_coord::transport::Envelope;

fn all() -> Vec<Msg> {
    vec![
        Msg::Snapshot { epoch: 1 },
        Msg::TransientSnapFin { epoch: 2 },
        Msg::AllTransientSnapFin { epoch: 3 },
        Msg::FullSnapFin { epoch: 4 },
        Msg::AllFullSnapFin { epoch: u64::MAX },
        Msg::Failed {
            epoch: 6,
            error: "disk \"full\"\nsecond line ✓".into(),
        },
        Msg::Abort {
            epoch: 7,
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
    names.dedup();
    assert_eq!(names.len(), 7);
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
        serde_json::to_value(Msg::Failed {
            epoch: 9,
            error: "x".into()
        })
        .unwrap(),
        serde_json::json!({"type": "FAILED", "epoch": 9, "error": "x"})
    );
    let m = Msg::from_json_line(r#"{"epoch":5,"type":"ALL_FULL_SNAP_FIN"}"#).unwrap();
    assert_eq!(m, Msg::AllFullSnapFin { epoch: 5 });
}
