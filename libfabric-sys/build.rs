//! Generates the bindings from the installed libfabric headers.
//!
//! libfabric is looked for in this order:
//! 1. `LIBFABRIC_HOME` (a prefix with `include/rdma/fabric.h` and `lib/` or `lib64/`);
//! 2. `/opt/amazon/efa` (where AWS's EFA installer puts its newer libfabric);
//! 3. pkg-config (`libfabric`), e.g. Debian's `libfabric-dev`.
//!
//! libfabric's data-path calls (`fi_domain`, `fi_writemsg`, `fi_cq_read`, ...) are
//! `static inline`; bindgen's `wrap_static_fns` writes a C file of callable shims, which
//! this script compiles with `cc`.

use std::env;
use std::path::{Path, PathBuf};

/// Where the headers and the library were found.
struct Found {
    include: Vec<PathBuf>,
    /// The directory of libfabric.so, where known (pkg-config may leave it to the linker's
    /// default path).
    lib_dir: Option<PathBuf>,
}

fn from_prefix(prefix: &Path) -> Option<Found> {
    let include = prefix.join("include");
    if !include.join("rdma/fabric.h").is_file() {
        return None;
    }
    let lib_dir = ["lib64", "lib"]
        .iter()
        .map(|d| prefix.join(d))
        .find(|d| d.join("libfabric.so").exists() || d.join("libfabric.a").exists())?;
    Some(Found {
        include: vec![include],
        lib_dir: Some(lib_dir),
    })
}

fn find() -> Found {
    println!("cargo:rerun-if-env-changed=LIBFABRIC_HOME");
    if let Some(home) = env::var_os("LIBFABRIC_HOME") {
        let home = PathBuf::from(home);
        return from_prefix(&home).unwrap_or_else(|| {
            panic!(
                "LIBFABRIC_HOME={} has no include/rdma/fabric.h with lib/libfabric.so or \
                 lib64/libfabric.so",
                home.display()
            )
        });
    }
    if let Some(found) = from_prefix(Path::new("/opt/amazon/efa")) {
        return found;
    }
    match pkg_config::Config::new()
        .atleast_version("1.10")
        .cargo_metadata(false)
        .probe("libfabric")
    {
        Ok(lib) => Found {
            include: lib.include_paths,
            lib_dir: lib.link_paths.first().cloned(),
        },
        Err(e) => panic!(
            "libfabric not found: set LIBFABRIC_HOME, install AWS's EFA software in \
             /opt/amazon/efa, or install libfabric-dev (apt-get install libfabric-dev \
             libclang-dev clang pkg-config). pkg-config said: {e}"
        ),
    }
}

/// Gives `FI_*` macros the width of the field they are used with: flag and capability bits
/// are `u64`, error numbers `i32` (they are returned negated as `int` / `ssize_t`).
#[derive(Debug)]
struct MacroWidths;

impl bindgen::callbacks::ParseCallbacks for MacroWidths {
    fn int_macro(&self, name: &str, _value: i64) -> Option<bindgen::callbacks::IntKind> {
        use bindgen::callbacks::IntKind;
        match name {
            "FI_EVENT" => Some(IntKind::U64),
            "FI_SUCCESS" => Some(IntKind::I32),
            n if n.starts_with("FI_E") => Some(IntKind::I32),
            "FI_MAJOR_VERSION" | "FI_MINOR_VERSION" | "FI_REVISION_VERSION" => Some(IntKind::U32),
            n if n.starts_with("FI_") => Some(IntKind::U64),
            _ => None,
        }
    }
}

fn main() {
    let found = find();
    let include_dirs: Vec<String> = found
        .include
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    println!("cargo:include={}", include_dirs.join(":"));

    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let header = manifest.join("wrapper.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let shim = out.join("static_fns");

    let bindings = bindgen::Builder::default()
        .header(header.display().to_string())
        .clang_args(include_dirs.iter().map(|d| format!("-I{d}")))
        .allowlist_function("fi_.*")
        .allowlist_type("fi_.*|fid.*")
        .allowlist_var("FI_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .use_core()
        .derive_default(true)
        .generate_comments(false)
        .layout_tests(false)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&shim)
        .parse_callbacks(Box::new(MacroWidths))
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate()
        .expect("bindgen could not read the libfabric headers (is libclang-dev installed?)");
    let text = bindings.to_string();
    // Headers of libfabric >= 1.20 have dmabuf registration (`struct fi_mr_dmabuf`, and
    // `fi_mr_attr.mr_iov` moves into a union). Dependents read this as
    // DEP_FABRIC_MR_DMABUF and pick the matching field layout.
    let dmabuf = text.contains("pub struct fi_mr_dmabuf");
    println!("cargo:mr_dmabuf={}", u8::from(dmabuf));
    std::fs::write(out.join("bindings.rs"), text).expect("write bindings.rs");

    let mut cc = cc::Build::new();
    cc.file(shim.with_extension("c"))
        .include(&manifest)
        .warnings(false);
    for dir in &found.include {
        cc.include(dir);
    }
    // The shim calls into libfabric, so libfabric comes after it on the link line.
    cc.compile("fabric_static_fns");
    if let Some(dir) = &found.lib_dir {
        println!("cargo:rustc-link-search=native={}", dir.display());
        // Dependents read this as DEP_FABRIC_LIB_DIR (for an rpath or LD_LIBRARY_PATH).
        println!("cargo:lib_dir={}", dir.display());
    }
    println!("cargo:rustc-link-lib=fabric");
}
