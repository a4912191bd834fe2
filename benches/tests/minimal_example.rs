//! Runs `examples/minimal.rs`, the README's program, so that neither can rot.
include!("../examples/minimal.rs");

#[test]
fn minimal_example_runs() {
    main().expect("the minimal example succeeds");
}

#[test]
fn readme_shows_the_minimal_example_verbatim() {
    let readme = include_str!("../../README.md");
    let example = include_str!("../examples/minimal.rs");
    assert!(
        readme.contains(&format!("```rust\n{example}```")),
        "README.md's program differs from benches/examples/minimal.rs: make them identical"
    );
}
