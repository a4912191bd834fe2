//! Bad topology input gives the right error variant, never a panic.

use std::path::PathBuf;

use topology::{Topology, TopologyError};

fn p5_xml() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/p5.48xlarge.xml");
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn malformed_xml_is_invalid_xml() {
    let truncated = p5_xml();
    let truncated = &truncated[..truncated.len() / 2];
    for (what, xml) in [
        ("truncated", truncated),
        ("not XML", "this is not xml at all"),
        ("empty", ""),
        (
            "unclosed tags",
            "<topology version=\"2.0\"><object type=\"Machine\">",
        ),
        (
            "not a topology",
            "<?xml version=\"1.0\"?><html><body/></html>",
        ),
        (
            "no objects",
            "<?xml version=\"1.0\"?><topology version=\"2.0\"></topology>",
        ),
    ] {
        match Topology::from_xml_str(xml) {
            Err(TopologyError::InvalidXml { origin, source }) => {
                assert_eq!(origin, "<string>", "{what}");
                assert!(!source.to_string().is_empty(), "{what}");
            }
            other => panic!("{what}: expected InvalidXml, got {other:?}"),
        }
    }
}

#[test]
fn nul_and_odd_encodings_are_invalid_xml_not_panics() {
    let with_nul = p5_xml().replacen("<topology", "<topo\0logy", 1);
    assert!(matches!(
        Topology::from_xml_str(&with_nul),
        Err(TopologyError::InvalidXml { .. })
    ));
    let body = "<topology version=\"2.0\"><object type=\"Machine\"/></topology>";
    for encoding in ["UTF-16", "EBCDIC", "no-such-encoding"] {
        let xml = format!("<?xml version=\"1.0\" encoding=\"{encoding}\"?>{body}");
        let result = Topology::from_xml_str(&xml);
        assert!(
            matches!(result, Err(TopologyError::InvalidXml { .. })),
            "{encoding}: {result:?}"
        );
    }
}

#[test]
fn missing_file_is_read_xml_file() {
    let path = PathBuf::from("/nonexistent/dir/topology.xml");
    match Topology::from_xml_file(&path) {
        Err(TopologyError::ReadXmlFile {
            path: reported,
            source,
        }) => {
            assert_eq!(reported, path);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected ReadXmlFile, got {other:?}"),
    }
    // A directory is not a file either.
    assert!(matches!(
        Topology::from_xml_file(env!("CARGO_MANIFEST_DIR")),
        Err(TopologyError::ReadXmlFile { .. })
    ));
}

#[test]
fn malformed_file_names_the_file() {
    let dir = std::env::temp_dir().join(format!("topology-bad-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("broken.xml");
    std::fs::write(&path, "<topology version=\"2.0\"><object").unwrap();
    let result = Topology::from_xml_file(&path);
    std::fs::remove_dir_all(&dir).unwrap();
    match result {
        Err(TopologyError::InvalidXml { origin, .. }) => {
            assert_eq!(origin, path.display().to_string());
        }
        other => panic!("expected InvalidXml, got {other:?}"),
    }
}

#[test]
fn newer_major_version_is_unsupported() {
    let v3 = p5_xml().replacen(
        r#"<topology version="2.0">"#,
        r#"<topology version="3.0">"#,
        1,
    );
    match Topology::from_xml_str(&v3) {
        Err(TopologyError::UnsupportedXmlVersion { origin, found }) => {
            assert_eq!(origin, "<string>");
            assert_eq!(found, "3.0");
        }
        other => panic!("expected UnsupportedXmlVersion, got {other:?}"),
    }
    let error = Topology::from_xml_str(&v3).unwrap_err();
    assert!(error.to_string().contains("3.0"), "{error}");
}

#[test]
fn error_messages_are_readable() {
    let error = Topology::from_xml_str("garbage").unwrap_err();
    let source = std::error::Error::source(&error).expect("hwloc error as source");
    assert!(source.to_string().contains("hwloc_topology"), "{source}");
}
