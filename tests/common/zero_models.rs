//! Models with zero-size layers for tests/ops/zero_size.rs and tests/fsdp/fsdp_zero_size.rs: a
//! [`Fork`] adds a branch of empty Linears, `Linear(5, 0)` then `Linear(0, 3)`, beside a
//! normal `Linear(5, 3)`.
#![allow(dead_code)]

use fsdp::nn::{ChildVisitor, Context, InitKey, Linear, Module, Sequential, GELU};
use fsdp::ops;
use fsdp::tensor::Tensor;
use fsdp::Result;

/// `y = a(x) + b(x)` (two branches on one input, summed), and `dx = da + db`.
pub struct Fork {
    pub a: Box<dyn Module>,
    pub b: Box<dyn Module>,
}

impl Module for Fork {
    fn type_name(&self) -> &str {
        "Fork"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let ya = self.a.forward(x, cx)?;
        let yb = self.b.forward(x, cx)?;
        ops::add(&ya, &yb)
    }
    fn backward(&mut self, dy: &Tensor, cx: &Context) -> Result<Tensor> {
        let da = self.a.backward(dy, cx)?;
        let db = self.b.backward(dy, cx)?;
        ops::add(&da, &db)
    }
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        f("a", &mut self.a)?;
        f("b", &mut self.b)
    }
    fn for_each_param(&mut self, f: &mut fsdp::nn::ParamVisitor<'_>) -> fsdp::Result<()> {
        fsdp::nn::no_params(f)
    }
}

/// `Linear(7, 5) - GELU - Fork(Linear(5, 3), [Linear(5, 0), Linear(0, 3, bias)]) - GELU -
/// Linear(3, 1, no bias)`, seed `seed`. The empty branch's output is the bias of its
/// `Linear(0, 3)` broadcast over the rows; `empty_bias: false` makes it zeros, so the
/// model computes exactly what [`without_empty_branch`] computes.
///
/// Parameters (name: shape): `0.weight [5, 7]`, `0.bias [5]`, `2.a.weight [3, 5]`,
/// `2.a.bias [3]`, `2.b.0.weight [0, 5]`, `2.b.0.bias [0]`, `2.b.1.weight [3, 0]`,
/// (`2.b.1.bias [3]`), `4.weight [1, 3]`.
pub fn with_empty_branch(seed: u64, empty_bias: bool) -> Box<dyn Module> {
    let k = InitKey::new(seed);
    let empty: Box<dyn Module> = Box::new(Sequential::new(vec![
        Box::new(Linear::new(5, 0, true, &k.child("2.b.0")).unwrap()),
        Box::new(Linear::new(0, 3, empty_bias, &k.child("2.b.1")).unwrap()),
    ]));
    Box::new(Sequential::new(vec![
        Box::new(Linear::new(7, 5, true, &k.child("0")).unwrap()),
        Box::new(GELU::new()),
        Box::new(Fork {
            a: Box::new(Linear::new(5, 3, true, &k.child("2.a")).unwrap()),
            b: empty,
        }),
        Box::new(GELU::new()),
        Box::new(Linear::new(3, 1, false, &k.child("4")).unwrap()),
    ]))
}

/// [`with_empty_branch`] without the empty branch, with the same initial values; its
/// `2.weight`, `2.bias` are the other's `2.a.weight`, `2.a.bias` ([`same_name`]).
pub fn without_empty_branch(seed: u64) -> Box<dyn Module> {
    let k = InitKey::new(seed);
    Box::new(Sequential::new(vec![
        Box::new(Linear::new(7, 5, true, &k.child("0")).unwrap()),
        Box::new(GELU::new()),
        Box::new(Linear::new(5, 3, true, &k.child("2.a")).unwrap()),
        Box::new(GELU::new()),
        Box::new(Linear::new(3, 1, false, &k.child("4")).unwrap()),
    ]))
}

/// The zero-size parameters of [`with_empty_branch`] and their shapes.
pub const EMPTY_PARAMS: [(&str, &[usize]); 3] = [
    ("2.b.0.weight", &[0, 5]),
    ("2.b.0.bias", &[0]),
    ("2.b.1.weight", &[3, 0]),
];

/// Step `step`'s batch of [`with_empty_branch`]: rows `lo..hi` of 12 rows, `x (rows, 7)`,
/// `y (rows, 1)`.
pub fn batch(step: usize, lo: usize, hi: usize) -> (Tensor, Tensor) {
    let x = crate::common::values(500 + step as u64, 12 * 7);
    let y = crate::common::values(600 + step as u64, 12);
    (
        Tensor::from_vec(x[lo * 7..hi * 7].to_vec(), &[hi - lo, 7]).unwrap(),
        Tensor::from_vec(y[lo..hi].to_vec(), &[hi - lo, 1]).unwrap(),
    )
}

/// The name in [`without_empty_branch`] of a non-empty parameter of [`with_empty_branch`].
pub fn same_name(name: &str) -> String {
    name.replace("2.a.", "2.")
}
