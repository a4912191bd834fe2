//! The README's Rust program is `examples/minimal.rs`, verbatim, and it runs.
include!("../examples/minimal.rs");

#[test]
fn the_readme_program_runs() {
    main().expect("the README's program succeeds");
}

#[test]
fn the_readme_shows_the_program_verbatim() {
    let readme = include_str!("../../README.md");
    let example = include_str!("../examples/minimal.rs");
    assert!(
        readme.contains(&format!("```rust\n{example}```")),
        "README.md's program differs from xfer/examples/minimal.rs: make them identical"
    );
}
