//! Golden per-step losses of a small GPT on the synthetic corpus (llm.c's expected-loss
//! check): any change to the numerics of a layer, the optimizer, the data order or FSDP's
//! reductions shows up here. After an intentional numeric change, regenerate with
//! `FSDP_BLESS=1 cargo test --test train golden_losses::` and say why in the commit.

use crate::common;

use fsdp::train::{train, Silent, TrainConfig};

const GOLDEN: &str = "tests/golden/small_gpt_losses.json";

#[test]
fn small_gpt_losses_match_the_checked_in_curve() {
    let cfg = TrainConfig {
        steps: 20,
        world_size: 2,
        ..common::small_job(common::corpus_file("golden"), 2)
    };
    let losses = train(&cfg, &Silent).unwrap().losses();
    if std::env::var_os("FSDP_BLESS").is_some() {
        std::fs::write(GOLDEN, serde_json::to_string_pretty(&losses).unwrap()).unwrap();
        return;
    }
    let golden: Vec<f32> = serde_json::from_str(&std::fs::read_to_string(GOLDEN).unwrap()).unwrap();
    // Relative 1e-4: room for a different but equally valid summation order on another
    // CPU (GEMM kernels differ between AVX2 and AVX-512), none for a changed computation.
    common::assert_close("golden losses", &losses, &golden, 0.0, 1e-4);
}
