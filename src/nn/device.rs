//! Moving a module's parameters between devices (`torch.nn.Module.to(device)`).

use super::{Module, Parameter};
use crate::backend::Device;
use crate::error::Result;
use crate::tensor::Tensor;

/// Moves every parameter below `m`, its gradient, and every buffer
/// ([`ModuleBuffer`](super::ModuleBuffer)) to `device`, in place (`model.to(device)`). Parameters already there are left alone (no copy); tied parameters
/// (one tensor under two names, [`Parameter::tie_to`]) stay tied; a meta parameter with an
/// initializer is materialized on `device`. Saved activations of an unfinished forward are
/// not moved. Move a model before wrapping it in FSDP: a unit's parameters are views of its
/// FlatParameter, which FSDP places itself.
///
/// # Errors
/// `InvalidArgument` when `m` is or contains an FSDP unit (nothing is moved then);
/// [`crate::Error::Cuda`] when the device is unavailable or out of memory (parameters moved until
/// then stay moved); `NotMaterialized` for a meta parameter without an initializer.
pub fn module_to_device(m: &mut dyn Module, device: Device) -> Result<()> {
    if let Some(name) = super::first_fsdp_unit(m, "")? {
        crate::error::bail_arg!(
            "module_to_device: '{}' is an FSDP unit; move the model before wrapping it (FSDP places its FlatParameters)",
            if name.is_empty() { "the module" } else { &name }
        );
    }
    let mut moved: Vec<(Tensor, Tensor)> = Vec::new();
    super::visit_parameters(m, "", false, &mut |_, p| {
        move_parameter(p, device, &mut moved)
    })?;
    super::buffers_to_device(m, "", false, device)
}

/// Converts every floating-point parameter and buffer below `m` to `dtype`, in place
/// (`model.to(dtype)`, e.g. `model.double()`): f32 or f64. Integer buffers
/// (`num_batches_tracked`) keep their dtype, as PyTorch's. Gradients are dropped (their
/// dtype would no longer match). Convert before wrapping in FSDP.
///
/// # Errors
/// `InvalidArgument` for a dtype other than f32 and f64, or when `m` contains an FSDP
/// unit; `NotMaterialized` for a meta parameter without an initializer.
pub fn module_to_dtype(m: &mut dyn Module, dtype: crate::tensor::DType) -> Result<()> {
    use crate::tensor::DType;
    if !matches!(dtype, DType::F32 | DType::F64) {
        crate::error::bail_arg!("module_to_dtype: f32 or f64, not {dtype}");
    }
    if super::first_fsdp_unit(m, "")?.is_some() {
        crate::error::bail_arg!("module_to_dtype: convert the model before wrapping it in FSDP");
    }
    let mut done: Vec<(Tensor, Tensor)> = Vec::new();
    super::visit_parameters(m, "", false, &mut |_, p| {
        let Ok(d) = p.data() else { return Ok(()) };
        if d.dtype() == dtype || !d.dtype().is_float() {
            return Ok(());
        }
        // Tied parameters stay one tensor.
        let c = match done.iter().find(|(src, _)| src.same_view(d)) {
            Some((_, c)) => c.clone(),
            None => {
                let c = d.materialize()?.to_dtype(dtype)?;
                done.push((d.clone(), c.clone()));
                c
            }
        };
        p.set_grad(None);
        p.set_data(Some(c))
    })?;
    super::visit_buffers(m, "", false, &mut |_, b| {
        if b.data.dtype().is_float() && b.data.dtype() != dtype {
            b.data = b.data.to_dtype(dtype)?;
        }
        Ok(())
    })
}

/// `t` on `device`, reusing the copy made for an earlier tensor of the same view.
fn moved_view(t: &Tensor, device: Device, moved: &mut Vec<(Tensor, Tensor)>) -> Result<Tensor> {
    if t.device() == device {
        return Ok(t.clone());
    }
    if let Some((_, m)) = moved.iter().find(|(src, _)| src.same_view(t)) {
        return Ok(m.clone());
    }
    let m = t.to_device(device)?;
    moved.push((t.clone(), m.clone()));
    Ok(m)
}

fn move_parameter(
    p: &mut Parameter,
    device: Device,
    moved: &mut Vec<(Tensor, Tensor)>,
) -> Result<()> {
    if let Ok(d) = p.data() {
        let d = moved_view(d, device, moved)?;
        p.set_data(Some(d))?;
    }
    if let Some(g) = p.grad() {
        let g = moved_view(g, device, moved)?;
        p.set_grad(Some(g));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::{InitKey, Linear, ParamVisitor};
    use crate::tensor::Tensor;

    /// Two parameters, the second tied to the first.
    struct Tied {
        a: Parameter,
        b: Parameter,
    }

    impl Module for Tied {
        fn type_name(&self) -> &str {
            "Tied"
        }
        fn forward(&mut self, x: &Tensor, _: &crate::nn::Context) -> Result<Tensor> {
            Ok(x.clone())
        }
        fn backward(&mut self, dy: &Tensor, _: &crate::nn::Context) -> Result<Tensor> {
            Ok(dy.clone())
        }
        fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
            f("a", &mut self.a)?;
            f("b", &mut self.b)
        }
        fn for_each_child(&mut self, f: &mut crate::nn::ChildVisitor<'_>) -> Result<()> {
            crate::nn::no_children(f)
        }
    }

    #[test]
    fn ties_survive_a_move_and_tensors_already_there_stay() -> Result<()> {
        let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?;
        let mut m = Tied {
            a: Parameter::new("a", w.clone()),
            b: Parameter::new("b", Tensor::zeros(&[3], crate::tensor::DType::F32)),
        };
        m.b.tie_to(&m.a)?;
        module_to_device(&mut m, Device::Cpu)?;
        assert!(m.a.data()?.same_view(&w), "no copy when already there");
        module_to_device(&mut m, Device::Meta)?;
        assert_eq!((m.a.device(), m.b.device()), (Device::Meta, Device::Meta));
        assert!(m.b.data()?.same_view(m.a.data()?), "still one tensor");
        Ok(())
    }

    #[test]
    fn meta_parameters_are_materialized() -> Result<()> {
        let mut l = crate::nn::on_meta_device(|| Linear::new(4, 3, true, &InitKey::new(5)))?;
        assert_eq!(l.weight.device(), Device::Meta);
        module_to_device(&mut l, Device::Cpu)?;
        let want = Linear::new(4, 3, true, &InitKey::new(5))?;
        assert_eq!(
            l.weight.data()?.to_vec_f32()?,
            want.weight.data()?.to_vec_f32()?
        );
        assert_eq!(l.weight.device(), Device::Cpu);
        Ok(())
    }
}
