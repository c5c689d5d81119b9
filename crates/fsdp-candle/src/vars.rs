//! Between candle and fsdp tensors: the model's vars as the builder asks for them
//! ([`declare`]), fsdp's gathered parameters as candle tensors ([`to_candle`]) and candle's
//! gradients added into fsdp's gradient views ([`add_grad`]). Each is one copy: candle
//! tensors own their storage, so neither side can view the other's memory.

use crate::error::{candle, Error, Result};
use candle::{DType, Device, Shape, Storage, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use std::sync::{Arc, Mutex};

/// A `VarBuilder` backend that serves vars from a `VarMap` (creating missing ones with the
/// builder's initializer when `create`) and records the names in the order asked.
struct Recorder {
    map: VarMap,
    create: bool,
    order: Arc<Mutex<Vec<String>>>,
}

impl Recorder {
    fn record(&self, name: &str) {
        if let Ok(mut o) = self.order.lock() {
            if !o.iter().any(|n| n == name) {
                o.push(name.to_string());
            }
        }
    }
}

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle::Result<Tensor> {
        if !self.create && !self.map.contains_tensor(name) {
            candle::bail!("var '{name}' is asked for by the builder but is not in the VarMap given")
        }
        let t = self.map.get(s, name, h, dtype, dev)?;
        self.record(name);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle::Result<Tensor> {
        let var = self
            .map
            .data()
            .lock()
            .ok()
            .and_then(|d| d.get(name).cloned());
        match var {
            Some(v) => {
                self.record(name);
                v.as_tensor().to_device(dev)?.to_dtype(dtype)
            }
            None => candle::bail!("var '{name}' has no shape to create it with (get_unchecked)"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.map.contains_tensor(name)
    }
}

/// A var of the model: its name, shape and initial f32 values (row-major).
pub(crate) struct Declared {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) values: Vec<f32>,
}

/// Builds the model once on the CPU in f32 from `map` (creating its vars with candle's
/// initializers when `create`, else taking every var from it) and returns its vars in the
/// order the builder asked for them. The built model is dropped.
///
/// # Errors
/// `Candle` when the builder fails; `InvalidArgument` when `map` holds vars the builder
/// never asks for (given values that would be silently left out), or a var is not on the
/// CPU.
pub(crate) fn declare<M>(
    build: &dyn Fn(VarBuilder) -> candle::Result<M>,
    map: VarMap,
    create: bool,
) -> Result<Vec<Declared>> {
    let order = Arc::new(Mutex::new(Vec::new()));
    let rec = Recorder {
        map: map.clone(),
        create,
        order: order.clone(),
    };
    let vb = VarBuilder::from_backend(Box::new(rec), DType::F32, Device::Cpu);
    let model = build(vb).map_err(candle("the model builder"))?;
    drop(model);
    let order = order.lock().map(|o| o.clone()).map_err(|_| {
        Error::InvalidArgument("the builder panicked while asking for a var".into())
    })?;
    let data = map
        .data()
        .lock()
        .map_err(|_| Error::InvalidArgument("the VarMap's lock is poisoned".into()))?
        .clone();
    if let Some(extra) = data.keys().find(|k| !order.contains(k)) {
        return Err(Error::InvalidArgument(format!(
            "the VarMap holds var '{extra}', which the model builder never asks for"
        )));
    }
    let mut out = Vec::with_capacity(order.len());
    for name in order {
        let Some(v) = data.get(&name) else { continue };
        if !v.device().is_cpu() {
            return Err(Error::InvalidArgument(format!(
                "var '{name}' is on {:?}: fsdp-candle trains on the CPU",
                v.device()
            )));
        }
        let t = v.as_tensor();
        let values = t
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(candle("reading the initial values"))?;
        out.push(Declared {
            name,
            shape: t.dims().to_vec(),
            values,
        });
    }
    Ok(out)
}

/// A candle tensor (a var when `var`, to receive a gradient) holding a copy of fsdp's
/// gathered f32 parameter `view`.
///
/// # Errors
/// `Fsdp` when the view is not an f32 host tensor; `Candle` on allocation failure.
pub(crate) fn to_candle(view: &fsdp::tensor::Tensor, var: bool) -> Result<Tensor> {
    let data = view.f32()?;
    let shape = view.shape();
    let t = match var {
        true => Var::from_slice(&data, shape, &Device::Cpu).map(Var::into_inner),
        false => Tensor::from_slice(&data, shape, &Device::Cpu),
    };
    t.map_err(candle("copying a gathered parameter into candle"))
}

/// `dst += g`: candle's gradient of one parameter added into fsdp's gradient view `dst`
/// (f32, the parameter's shape).
///
/// # Errors
/// `InvalidArgument` when the shapes differ; `Candle` when `g` cannot be read as f32.
pub(crate) fn add_grad(name: &str, dst: &fsdp::tensor::Tensor, g: &Tensor) -> Result<()> {
    if g.dims() != dst.shape() {
        return Err(Error::InvalidArgument(format!(
            "the gradient of '{name}' has shape {:?}, the parameter {:?}",
            g.dims(),
            dst.shape()
        )));
    }
    let mut out = dst.f32_mut()?;
    let add = |out: &mut [f32], src: &[f32]| {
        for (o, s) in out.iter_mut().zip(src) {
            *o += s;
        }
    };
    if g.dtype() == DType::F32 {
        let (storage, layout) = g.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((lo, hi))) = (&*storage, layout.contiguous_offsets()) {
            let src = cpu
                .as_slice::<f32>()
                .map_err(candle("reading a gradient"))?;
            add(&mut out, &src[lo..hi]);
            return Ok(());
        }
    }
    // Strided or another dtype: one contiguous f32 copy first.
    let v = g
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(candle("reading a gradient"))?;
    add(&mut out, &v);
    Ok(())
}
