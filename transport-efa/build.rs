//! Picks the `fi_mr_attr` layout of the libfabric headers that libfabric-sys was built
//! with: from 1.20 on, `mr_iov` shares a union with `dmabuf` (cfg `fi_mr_dmabuf`).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(fi_mr_dmabuf)");
    println!("cargo:rerun-if-env-changed=DEP_FABRIC_MR_DMABUF");
    if std::env::var("DEP_FABRIC_MR_DMABUF").as_deref() == Ok("1") {
        println!("cargo:rustc-cfg=fi_mr_dmabuf");
    }
}
