//! Issue 18, points 1 and 2: a model cannot lose its parameters silently (the visitors are
//! required; FSDP refuses a model without parameters), and the named containers reproduce
//! PyTorch's `named_parameters()` names, so `state_dict` / `load_state_dict` (strict, with
//! FSDP's checks) and PyTorch-saved safetensors files (`tests/torch_ref/modules/`, made by
//! `tests/torch_ref/make_module_refs.py`) work on any model, wrapped or not.

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel};
use fsdp::nn::{
    self, Block, ChildVisitor, Context, Embedding, GptConfig, InitKey, LayerNorm, Linear, Module,
    ModuleDict, ModuleList, ParamVisitor, ReLU, Sequential, GPT,
};
use fsdp::tensor::Tensor;
use fsdp::{Error, Result};
use std::path::Path;

use crate::common;

use common::MODULE_REFS as REFS;

fn strings(v: &serde_json::Value) -> Vec<String> {
    serde_json::from_value(v.clone()).unwrap()
}

fn names(m: &mut dyn Module) -> Vec<String> {
    nn::parameter_shapes(m)
        .into_iter()
        .map(|(n, _)| n)
        .collect()
}

fn load_file(name: &str) -> Result<nn::FullStateDict> {
    fsdp::checkpoint::load_state_dict_file(&Path::new(REFS).join(name))
}

fn max_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
        .fold(0.0, f32::max)
}

// ---------------------------------------------------------------------------------------
// Point 1

/// The report's bug: a layer that holds a Linear but lists neither it nor its parameters.
/// (It must say so: `for_each_param` and `for_each_child` have no default.)
struct Forgetful {
    fc: Linear,
}

impl Module for Forgetful {
    fn type_name(&self) -> &str {
        "Forgetful"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.fc.forward(x, cx)
    }
    fn backward(&mut self, dy: &Tensor, cx: &Context) -> Result<Tensor> {
        self.fc.backward(dy, cx)
    }
    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        nn::no_params(f)
    }
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        nn::no_children(f)
    }
}

#[test]
fn wrapping_a_model_without_parameters_is_an_error_naming_it() {
    let errs = launch(&LaunchOptions::new(2), |pg| {
        let fc = Linear::new(3, 2, true, &InitKey::new(0))?;
        let e = FullyShardedDataParallel::new(
            Box::new(Forgetful { fc }),
            pg.clone(),
            FsdpConfig::default(),
        );
        let e2 = FullyShardedDataParallel::new(
            Box::new(Sequential::new(vec![Box::new(ReLU::new())])),
            pg,
            FsdpConfig::default(),
        );
        Ok((
            e.err().map(|e| e.to_string()),
            e2.err().map(|e| e.to_string()),
        ))
    })
    .unwrap();
    for (e, e2) in errs {
        let e = e.expect("a model without parameters must not wrap");
        assert!(
            e.contains("'Forgetful'")
                && e.contains("has no parameters")
                && e.contains("for_each_param"),
            "{e}"
        );
        let e2 = e2.expect("Sequential(ReLU) must not wrap");
        assert!(
            e2.contains("'Sequential'") && e2.contains("has no parameters"),
            "{e2}"
        );
    }
}

/// A layer whose visitor repeats a name (two parameters "w", a parameter and a buffer "w"),
/// or names children "x" twice or "": their state-dict entries would collide, so a load
/// would write one value into both.
struct Clashing {
    a: Linear,
    b: Linear,
    buf: nn::ModuleBuffer,
    child_names: [&'static str; 2],
}

impl Module for Clashing {
    fn type_name(&self) -> &str {
        "Clashing"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.a.forward(x, cx)
    }
    fn backward(&mut self, dy: &Tensor, cx: &Context) -> Result<Tensor> {
        self.a.backward(dy, cx)
    }
    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        match self.child_names[0] {
            "params" => {
                f("w", &mut self.a.weight)?;
                f("w", &mut self.b.weight)
            }
            "buffer" => f("w", &mut self.a.weight),
            _ => Ok(()),
        }
    }
    fn for_each_buffer(&mut self, f: &mut nn::BufferVisitor<'_>) -> Result<()> {
        match self.child_names[0] {
            "buffer" => f("w", &mut self.buf),
            _ => Ok(()),
        }
    }
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        if matches!(self.child_names[0], "params" | "buffer") {
            return Ok(());
        }
        let mut a: Box<dyn Module> = Box::new(Linear::new(3, 2, true, &InitKey::new(1))?);
        let mut b: Box<dyn Module> = Box::new(Linear::new(3, 2, true, &InitKey::new(2))?);
        f(self.child_names[0], &mut a)?;
        f(self.child_names[1], &mut b)
    }
}

#[test]
fn repeated_or_empty_names_are_refused_by_state_dicts_and_fsdp() {
    let clashing = |names: [&'static str; 2]| -> Result<Clashing> {
        Ok(Clashing {
            a: Linear::new(3, 2, true, &InitKey::new(1))?,
            b: Linear::new(3, 2, true, &InitKey::new(2))?,
            buf: nn::ModuleBuffer::new(Tensor::from_vec(vec![0.0f32], &[1])?),
            child_names: names,
        })
    };
    for (names, want) in [
        (["params", ""], "names two parameters 'w'"),
        (
            ["buffer", ""],
            "names a buffer 'w' that is already a parameter or buffer",
        ),
        (["x", "x"], "names two parameters 'x.weight'"),
        (["x", ""], "names a child module \"\""),
    ] {
        let mut m = clashing(names).unwrap();
        let e = nn::state_dict(&mut m).unwrap_err().to_string();
        assert!(e.contains(want), "{names:?}: {e}");
        let sd = nn::state_dict(&mut clashing(["ok1", "ok2"]).unwrap()).unwrap();
        let e = nn::load_state_dict(&mut m, &sd, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{names:?}: {e}");
        let errs = launch(&LaunchOptions::new(2), move |pg| {
            let m = clashing(names)?;
            Ok(
                FullyShardedDataParallel::new(Box::new(m), pg, FsdpConfig::default())
                    .err()
                    .map(|e| e.to_string()),
            )
        })
        .unwrap();
        for e in errs {
            let e = e.expect("FSDP wrapped a model with clashing names");
            assert!(e.contains(want), "{names:?}: {e}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Point 2: names

/// `TransformerBlock` of the fourth FSDP docs example: `self.net = nn.Sequential(Linear,
/// ReLU, Linear)`, a type of its own for the wrap policy.
fn transformer_block(w: usize, k: &InitKey) -> Result<Box<dyn Module>> {
    let net = Sequential::new(vec![
        Box::new(Linear::new(w, w, true, &k.child("0"))?),
        Box::new(ReLU::new()),
        Box::new(Linear::new(w, w, true, &k.child("2"))?),
    ]);
    Ok(Box::new(
        Sequential::named(vec![("net", Box::new(net) as Box<dyn Module>)])?
            .with_type_name("TransformerBlock"),
    ))
}

fn transformer_blocks(w: usize, out: usize, k: &InitKey) -> Result<Sequential> {
    let mut layers = Vec::new();
    for i in 0..4 {
        layers.push(transformer_block(w, &k.child(&i.to_string()))?);
    }
    layers.push(Box::new(Linear::new(w, out, true, &k.child("4"))?));
    Ok(Sequential::new(layers))
}

fn mlp(a: usize, b: usize, c: usize, k: &InitKey) -> Result<Sequential> {
    Ok(Sequential::new(vec![
        Box::new(Linear::new(a, b, true, &k.child("0"))?),
        Box::new(ReLU::new()),
        Box::new(Linear::new(b, c, true, &k.child("2"))?),
    ]))
}

#[test]
fn the_seed_examples_have_pytorch_parameter_names() -> Result<()> {
    let r = common::module_refs();
    let want = &r["seed_example_names"];
    let k = InitKey::new(0);
    assert_eq!(
        names(&mut mlp(1024, 512, 128, &k)?),
        strings(&want["simple_model"])
    );
    assert_eq!(
        names(&mut mlp(256, 128, 64, &k)?),
        strings(&want["shard_grad_op"])
    );
    assert_eq!(
        names(&mut Linear::new(2048, 2048, true, &k)?),
        strings(&want["big_model"])
    );
    assert_eq!(
        names(&mut transformer_blocks(512, 10, &k)?),
        strings(&want["transformer_blocks"])
    );
    Ok(())
}

/// nanoGPT's module tree: `transformer = ModuleDict(wte, wpe, h = ModuleList(Block...),
/// ln_f)`; `lm_head` is tied to `wte` (its weight is the tie's second name, so
/// `named_parameters()` leaves it out).
fn nanogpt_tree(c: GptConfig) -> Result<ModuleDict> {
    let k = InitKey::new(0);
    let mut h = ModuleList::new(Vec::new());
    for i in 0..c.n_layer {
        h.push(Box::new(Block::new(
            c.n_embd,
            c.n_head,
            &k.child(&i.to_string()),
        )?));
    }
    let transformer = ModuleDict::new(vec![
        (
            "wte",
            Box::new(Embedding::new(
                c.vocab_size,
                c.n_embd,
                0.02,
                &k.child("wte"),
            )?) as Box<dyn Module>,
        ),
        (
            "wpe",
            Box::new(Embedding::new(
                c.block_size,
                c.n_embd,
                0.02,
                &k.child("wpe"),
            )?),
        ),
        ("h", Box::new(h)),
        ("ln_f", Box::new(LayerNorm::new(c.n_embd)?)),
    ])?;
    ModuleDict::new(vec![(
        "transformer",
        Box::new(transformer) as Box<dyn Module>,
    )])
}

fn nanogpt_config(r: &serde_json::Value) -> GptConfig {
    serde_json::from_value(r["config"].clone()).unwrap()
}

#[test]
fn nanogpt_from_named_containers_has_its_names_and_loads_its_file() -> Result<()> {
    let r = &common::module_refs()["nanogpt"];
    let c = nanogpt_config(r);
    let mut tree = nanogpt_tree(c)?;
    assert_eq!(names(&mut tree), strings(&r["names"]));
    let sd = load_file("nanogpt.safetensors")?;
    assert_eq!(
        nn::load_state_dict(&mut tree, &sd, true)?,
        nn::IncompatibleKeys::default()
    );
    let back = nn::state_dict(&mut tree)?;
    for (n, t) in &back.tensors {
        assert_eq!(t.to_vec_f32()?, sd.get(n).unwrap().to_vec_f32()?, "{n}");
    }
    // The same file, keys renamed to fsdp's GPT (`wte.weight`, `blocks.{i}.*`), gives
    // PyTorch's logits.
    let mut gpt = GPT::new(c, 1)?;
    let renamed = nn::FullStateDict {
        tensors: sd
            .tensors
            .iter()
            .map(|(n, t)| {
                let n = n.strip_prefix("transformer.").unwrap_or(n);
                let n = n
                    .strip_prefix("h.")
                    .map_or(n.to_string(), |rest| format!("blocks.{rest}"));
                (n, t.clone())
            })
            .collect(),
    };
    nn::load_state_dict(&mut gpt, &renamed, true)?;
    let ids: Vec<i32> = r["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap() as i32)
        .collect();
    let logits = gpt.forward(&Tensor::from_vec(ids, &[2, 5])?, &Context::eval())?;
    let err = max_err(&logits.to_vec_f32()?, &common::json_f32s(&r["logits"]));
    assert!(err <= 1e-5, "GPT logits against PyTorch's: error {err:e}");
    Ok(())
}

#[test]
fn transformer_blocks_load_a_pytorch_file_and_wrap_by_type_name() -> Result<()> {
    let r = common::module_refs();
    let r = &r["transformer_blocks"];
    let x = common::json_f32s(&r["x"]);
    let want = common::json_f32s(&r["y"]);
    let outs = launch(&LaunchOptions::new(2), |pg| {
        let mut m = transformer_blocks(8, 3, &InitKey::new(5))?;
        assert_eq!(names(&mut m), strings(&r["names"]));
        nn::load_state_dict(&mut m, &load_file("transformer_blocks.safetensors")?, true)?;
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["TransformerBlock"])),
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(Box::new(m), pg, cfg)?;
        let mut units = 0;
        m.for_each_unit(&mut |_| {
            units += 1;
            Ok(())
        })?;
        let y = m.forward(&Tensor::from_vec(x.clone(), &[2, 8])?, &Context::eval())?;
        Ok((units, y.to_vec_f32()?))
    })?;
    for (units, y) in outs {
        assert_eq!(units, 5, "4 blocks + root, as PyTorch makes");
        let err = max_err(&y, &want);
        assert!(err <= 1e-6, "output against PyTorch's: error {err:e}");
    }
    Ok(())
}

#[test]
fn containers_check_names_and_have_no_forward_of_their_own() -> Result<()> {
    let relu = || Box::new(ReLU::new()) as Box<dyn Module>;
    for bad in ["", "a.b"] {
        assert!(
            matches!(Sequential::named(vec![(bad, relu())]), Err(Error::InvalidArgument(m)) if m.contains("no '.'"))
        );
    }
    assert!(
        matches!(Sequential::named(vec![("a", relu()), ("a", relu())]), Err(Error::InvalidArgument(m)) if m.contains("two children named 'a'"))
    );
    let mut d = ModuleDict::new(vec![("a", relu()), ("b", relu())])?;
    assert!(
        d.insert("a", Box::new(LayerNorm::new(2)?))?.is_some(),
        "replaced where it stands"
    );
    assert_eq!(d.names(), ["a", "b"]);
    assert_eq!(names(&mut d), ["a.weight", "a.bias"]);
    let x = Tensor::from_vec(vec![1.0f32; 2], &[1, 2])?;
    assert!(
        matches!(d.forward(&x, &Context::eval()), Err(Error::InvalidArgument(m)) if m.contains("no forward"))
    );
    let mut l = ModuleList::new(vec![relu()]).with_type_name("Layers");
    assert_eq!(l.type_name(), "Layers");
    assert!(l.forward(&x, &Context::eval()).is_err());
    // A parent reaches a ModuleList it holds boxed inside a ModuleDict (nanoGPT's
    // transformer.h) and runs its children.
    let h = ModuleList::new(vec![Box::new(LayerNorm::new(2)?), relu()]);
    let mut t = ModuleDict::new(vec![("h", Box::new(h) as Box<dyn Module>)])?;
    let h = t
        .get_mut("h")
        .and_then(|m| m.as_any_mut())
        .and_then(|a| a.downcast_mut::<ModuleList>())
        .expect("the boxed ModuleList downcasts");
    let mut y = Tensor::from_vec(vec![1.0f32, 3.0], &[1, 2])?;
    for (_, block) in h.iter_mut() {
        y = block.forward(&y, &Context::eval())?;
    }
    // LayerNorm of [1, 3] is [-1, 1] (to eps), then ReLU.
    let y = y.to_vec_f32()?;
    assert!(y[0] == 0.0 && (y[1] - 1.0).abs() < 1e-4, "{y:?}");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Point 2: state dicts

#[test]
fn load_state_dict_checks_like_fsdp_and_writes_nothing_on_error() -> Result<()> {
    let k = InitKey::new(3);
    let mut m = mlp(3, 4, 2, &k)?;
    let sd = nn::state_dict(&mut m)?;
    assert_eq!(
        sd.keys().collect::<Vec<_>>(),
        ["0.weight", "0.bias", "2.weight", "2.bias"]
    );
    let before = nn::state_dict(&mut m)?;
    // A wrong shape, a missing key and an unexpected one: one error naming all three.
    let mut bad = sd.clone();
    bad.tensors[0].1 = Tensor::from_vec(vec![0.0f32; 6], &[2, 3])?;
    bad.tensors.retain(|(n, _)| n != "2.bias");
    bad.tensors
        .push(("extra.weight".into(), Tensor::from_vec(vec![9.0f32], &[1])?));
    bad.tensors[1].1 = Tensor::from_vec(vec![7.0f32; 4], &[4])?; // would be written
    let e = nn::load_state_dict(&mut m, &bad, true).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::StateDict(_)), "{msg}");
    for part in [
        "'0.weight': expected shape [4, 3], got [2, 3]",
        "missing key(s): '2.bias' (expected shape [2])",
        "unexpected key(s): 'extra.weight'",
        "nothing was modified",
    ] {
        assert!(msg.contains(part), "{part:?} not in: {msg}");
    }
    for ((n, a), (_, b)) in nn::state_dict(&mut m)?.tensors.iter().zip(&before.tensors) {
        assert_eq!(a.to_vec_f32()?, b.to_vec_f32()?, "{n} was modified");
    }
    // Not strict: missing and unexpected keys are reported, the rest is loaded.
    bad.tensors[0].1 = sd.tensors[0].1.clone();
    let keys = nn::load_state_dict(&mut m, &bad, false)?;
    assert_eq!(keys.missing_keys, ["2.bias"]);
    assert_eq!(keys.unexpected_keys, ["extra.weight"]);
    assert_eq!(
        nn::state_dict(&mut m)?
            .get("0.bias")
            .unwrap()
            .to_vec_f32()?,
        [7.0; 4]
    );
    // Integer tensors are refused; shape errors also without strict.
    let mut ints = sd.clone();
    ints.tensors[3].1 = Tensor::from_vec(vec![1i32, 2], &[2])?;
    let e = nn::load_state_dict(&mut m, &ints, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("'2.bias': expected dtype f32, f64, bf16 or f16, got"),
        "{e}"
    );
    Ok(())
}

#[test]
fn state_dict_of_a_wrapped_model_is_that_of_the_unwrapped_one() -> Result<()> {
    let k = InitKey::new(11);
    let want = nn::state_dict(&mut transformer_blocks(5, 3, &k)?)?;
    let other = nn::state_dict(&mut transformer_blocks(5, 3, &InitKey::new(12))?)?;
    for w in [1, 3] {
        let outs = launch(&LaunchOptions::new(w), |pg| {
            let cfg = FsdpConfig {
                auto_wrap_policy: Some(transformer_auto_wrap_policy(["TransformerBlock"])),
                ..Default::default()
            };
            let mut m =
                FullyShardedDataParallel::new(Box::new(transformer_blocks(5, 3, &k)?), pg, cfg)?;
            let sd = nn::state_dict(&mut m)?;
            // Load another model's values through the same call, then read them back.
            nn::load_state_dict(&mut m, &other, true)?;
            let back = nn::state_dict(&mut m)?;
            Ok((sd, back))
        })?;
        for (sd, back) in outs {
            for ((got, expect), name) in [(&sd, &want), (&back, &other)]
                .into_iter()
                .zip(["state_dict", "after load"])
            {
                assert_eq!(
                    got.keys().collect::<Vec<_>>(),
                    expect.keys().collect::<Vec<_>>(),
                    "world {w}: {name}"
                );
                for ((n, a), (_, b)) in got.tensors.iter().zip(&expect.tensors) {
                    assert_eq!(a.to_vec_f32()?, b.to_vec_f32()?, "world {w}: {name}: {n}");
                }
            }
        }
    }
    Ok(())
}
