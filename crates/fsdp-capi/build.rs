//! Gives the integration tests the target triple: tests/capi compiles its C hosts with the
//! cc crate, which needs it (`FSDP_TARGET`).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!(
        "cargo:rustc-env=FSDP_TARGET={}",
        std::env::var("TARGET").unwrap_or_default()
    );
}
