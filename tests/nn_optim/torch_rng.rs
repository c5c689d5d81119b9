//! `fsdp::nn::TorchGenerator` against values printed by PyTorch 2.11 on the CPU
//! (`tests/torch_ref/rng_refs.json`, made by `tests/torch_ref/make_rng_refs.py`): raw
//! mt19937 draws, `uniform_`, `normal_` (both paths, the cached sample, the redrawn tail),
//! `randperm`, and the default initializers of `nn.Linear`, `nn.Embedding`, `nn.LayerNorm`
//! followed by `randn`. Every comparison is bitwise.

use fsdp::nn::torch_rng::{kaiming_uniform_bound, linear_parameters};
use fsdp::nn::{Embedding, InitKey, LayerNorm, Linear, TorchGenerator};
use serde_json::Value;

fn refs() -> Value {
    let text = std::fs::read_to_string("tests/torch_ref/rng_refs.json").unwrap();
    serde_json::from_str(&text).unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().parse().unwrap())
        .collect()
}

/// Asserts bitwise equality; on failure prints the first differing elements.
fn same_bits<T: Copy + PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad: Vec<(usize, T, T)> = (0..got.len())
        .filter(|&i| got[i] != want[i])
        .map(|i| (i, got[i], want[i]))
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} differ, first (index, got, want): {:?}",
        bad.len(),
        got.len(),
        &bad[..bad.len().min(5)]
    );
}

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bits64(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn raw_draws_match_pytorch() {
    let r = refs();
    for (seed, want) in r["raw_u32"].as_object().unwrap() {
        let want = u32s(want);
        let mut g = TorchGenerator::manual_seed(seed.parse().unwrap());
        let got: Vec<u32> = (0..want.len()).map(|_| g.random()).collect();
        same_bits(&format!("raw draws of seed {seed}"), &got, &want);
    }
    // std::mt19937's check value: the 10000th draw of the default seed 5489.
    let mut g = TorchGenerator::manual_seed(5489);
    let last = (0..10_000).map(|_| g.random()).last().unwrap();
    assert_eq!(last, 4_123_659_995);
}

#[test]
fn random64_puts_the_first_draw_high() {
    let mut a = TorchGenerator::manual_seed(9);
    let mut b = TorchGenerator::manual_seed(9);
    let (hi, lo) = (b.random() as u64, b.random() as u64);
    assert_eq!(a.random64(), (hi << 32) | lo);
}

#[test]
fn uniform_matches_pytorch_in_f32_and_f64() {
    for case in refs()["uniform"].as_array().unwrap() {
        let seed = case["seed"].as_u64().unwrap();
        let n = case["n"].as_u64().unwrap() as usize;
        let (lo, hi) = (case["from"].as_f64().unwrap(), case["to"].as_f64().unwrap());
        let mut g = TorchGenerator::manual_seed(seed);
        let mut a = vec![0f32; n];
        g.uniform_f32(&mut a, lo, hi);
        let mut b = vec![0f64; n];
        g.uniform_f64(&mut b, lo, hi);
        let what = format!("uniform_({lo}, {hi}) seed {seed}");
        same_bits(&format!("{what} f32"), &bits32(&a), &u32s(&case["f32"]));
        same_bits(&format!("{what} f64"), &bits64(&b), &u64s(&case["f64"]));
    }
}

#[test]
fn normal_matches_pytorch_on_both_paths_with_the_cached_sample() {
    let r = refs();
    for case in r["normal_f32"].as_array().unwrap() {
        let seed = case["seed"].as_u64().unwrap();
        let (mean, std) = (
            case["mean"].as_f64().unwrap(),
            case["std"].as_f64().unwrap(),
        );
        let mut g = TorchGenerator::manual_seed(seed);
        for (k, want) in case["f32"].as_array().unwrap().iter().enumerate() {
            let want = u32s(want);
            let mut v = vec![0f32; want.len()];
            g.normal_f32(&mut v, mean, std);
            let what = format!(
                "normal_({mean}, {std}) seed {seed} call {k} size {}",
                v.len()
            );
            same_bits(&what, &bits32(&v), &want);
        }
    }
    for case in r["normal_f64"].as_array().unwrap() {
        let seed = case["seed"].as_u64().unwrap();
        let mut g = TorchGenerator::manual_seed(seed);
        for (k, want) in case["f64"].as_array().unwrap().iter().enumerate() {
            let want = u64s(want);
            let mut v = vec![0f64; want.len()];
            g.normal_f64(&mut v, 0.0, 1.0);
            let what = format!("f64 normal_ seed {seed} call {k} size {}", v.len());
            same_bits(&what, &bits64(&v), &want);
        }
    }
}

#[test]
fn randperm_matches_pytorch() {
    for case in refs()["randperm"].as_array().unwrap() {
        let seed = case["seed"].as_u64().unwrap();
        let n = case["n"].as_u64().unwrap() as usize;
        let want: Vec<usize> = case["perm"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        let got = TorchGenerator::manual_seed(seed).randperm(n);
        assert_eq!(got, want, "randperm({n}) seed {seed}");
    }
    assert!(TorchGenerator::manual_seed(0).randperm(0).is_empty());
    assert_eq!(TorchGenerator::manual_seed(0).randperm(1), vec![0]);
}

#[test]
fn default_initializers_and_randn_match_pytorch() {
    let r = refs();
    let m = &r["modules_seed0"];
    let key = InitKey::torch(0);
    let want = |k: &str| u32s(&m[k]);
    let got = |t: &fsdp::tensor::Tensor| bits32(&t.to_vec_f32().unwrap());
    // Built in the order of make_rng_refs.py, through the module constructors.
    let lin = Linear::new(7, 5, true, &key.child("a")).unwrap();
    let lin2 = Linear::new(20, 3, false, &key.child("b")).unwrap();
    let emb = Embedding::new(6, 4, 1.0, &key.child("c")).unwrap();
    let ln = LayerNorm::new(3).unwrap();
    let lin3 = Linear::new(300, 2, true, &key).unwrap();
    let x = key.randn(&[3, 7]).unwrap();
    let checks = [
        ("linear_7_5.weight", lin.weight.data().unwrap().clone()),
        (
            "linear_7_5.bias",
            lin.bias.as_ref().unwrap().data().unwrap().clone(),
        ),
        (
            "linear_20_3_nobias.weight",
            lin2.weight.data().unwrap().clone(),
        ),
        ("embedding_6_4.weight", emb.weight.data().unwrap().clone()),
        ("layernorm_3.weight", ln.weight.data().unwrap().clone()),
        ("layernorm_3.bias", ln.bias.data().unwrap().clone()),
        ("linear_300_2.weight", lin3.weight.data().unwrap().clone()),
        (
            "linear_300_2.bias",
            lin3.bias.as_ref().unwrap().data().unwrap().clone(),
        ),
        ("randn_3_7", x),
    ];
    for (name, t) in &checks {
        same_bits(name, &got(t), &want(name));
    }
    assert!(lin2.bias.is_none());
}

#[test]
fn linear_bound_and_zero_sizes_follow_pytorch() {
    // kaiming_uniform_(a = sqrt(5)) is 1/sqrt(fan_in) up to f64 rounding.
    for fan in [1usize, 3, 256, 1000] {
        let b = kaiming_uniform_bound(5f64.sqrt(), fan);
        assert!((b - 1.0 / (fan as f64).sqrt()).abs() < 1e-15, "{fan}: {b}");
    }
    // Linear(0, 3): no weight draws (no elements), a zero bias that still takes 3 draws.
    let mut g = TorchGenerator::manual_seed(1);
    let (w, b) = linear_parameters(&mut g, 0, 3, true).unwrap();
    assert_eq!(w.shape(), &[3, 0]);
    assert_eq!(b.unwrap().to_vec_f32().unwrap(), vec![0.0; 3]);
    let mut h = TorchGenerator::manual_seed(1);
    for _ in 0..3 {
        h.random();
    }
    assert_eq!(g.random(), h.random());
}

#[test]
fn manual_seed_resets_the_cached_normal() {
    let mut g = TorchGenerator::manual_seed(4);
    let mut one = [0f32; 1];
    g.normal_f32(&mut one, 0.0, 1.0); // caches the pair's second half
    let first = one[0];
    let mut g = TorchGenerator::manual_seed(4);
    g.normal_f32(&mut one, 0.0, 1.0);
    assert_eq!(one[0], first);
}

#[test]
fn a_torch_key_is_shared_by_its_children_and_counter_keys_stay_the_default() {
    let key = InitKey::torch(0);
    let a = Linear::new(3, 2, true, &key.child("x")).unwrap();
    let b = Linear::new(3, 2, true, &key.child("x")).unwrap();
    // Two modules from one generator draw different values even under the same path.
    assert_ne!(
        a.weight.data().unwrap().to_vec_f32().unwrap(),
        b.weight.data().unwrap().to_vec_f32().unwrap()
    );
    let c1 = Linear::new(3, 2, true, &InitKey::new(0).child("x")).unwrap();
    let c2 = Linear::new(3, 2, true, &InitKey::new(0).child("x")).unwrap();
    assert_eq!(
        c1.weight.data().unwrap().to_vec_f32().unwrap(),
        c2.weight.data().unwrap().to_vec_f32().unwrap()
    );
    // Inside on_meta_device a torch key still computes its values.
    let m = fsdp::nn::on_meta_device(|| Linear::new(3, 2, true, &InitKey::torch(0)).unwrap());
    assert_eq!(
        m.weight.data().unwrap().device(),
        fsdp::backend::Device::Cpu
    );
}
