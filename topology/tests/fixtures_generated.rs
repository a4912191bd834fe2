//! The checked-in fixtures are exactly what the generator writes.

#[allow(dead_code, reason = "main() is for `cargo run --example gen_fixtures`")]
#[path = "../examples/gen_fixtures.rs"]
mod gen_fixtures;

#[test]
fn fixtures_match_generator() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for (name, expected) in gen_fixtures::fixtures() {
        let actual = std::fs::read_to_string(dir.join(name)).unwrap();
        assert!(
            actual == expected,
            "{name} differs from the generator: run `cargo run -p topology --example gen_fixtures`"
        );
    }
}
