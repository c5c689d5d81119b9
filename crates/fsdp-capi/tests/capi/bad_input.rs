//! `tests/capi/abi_checks.c`: bad input through the C ABI from C (NULL, forged, freed
//! and wrongly-typed handles; gradients of the wrong size, dtype, device or memory; calls
//! out of order; a unit used after its group was destroyed; a rank that leaves or stops
//! calling) returns the status of its class and a message naming the problem, and
//! changes nothing (a step with every bad gradient offered first equals a clean step,
//! bit for bit); a device that does not fit (a CUDA gradient for a CPU model, a bad
//! `fsdp_config.device`, a host collective given a stream or tensors of two devices);
//! plus the collectives, bfloat16 and float16 parameter views and bfloat16 gradients
//! under mixed precision, the state-dict callback and a checkpoint round trip.

use std::process::Command;

/// `(case, status, what the message must contain)`.
const CASES: &[(&str, &str, &str)] = &[
    (
        "init_unsupported_backend",
        "FSDP_ERR_UNSUPPORTED",
        "fsdp_init_process_group: not supported yet: backend \"mpi\"",
    ),
    (
        "init_rank_out_of_range",
        "FSDP_ERR_INVALID_ARGUMENT",
        "fsdp_init_options.rank 5 is not below the fsdp_init_options.world_size 2",
    ),
    (
        "init_null_out",
        "FSDP_ERR_INVALID_ARGUMENT",
        "out (the out-pointer) is NULL",
    ),
    (
        "null_model",
        "FSDP_ERR_INVALID_HANDLE",
        "fsdp_model_num_units: model is the null model (fsdp_model_t) handle (0)",
    ),
    (
        "group_as_model",
        "FSDP_ERR_INVALID_HANDLE",
        "model is a process group (fsdp_group_t) handle, not a model (fsdp_model_t)",
    ),
    (
        "forged_handle",
        "FSDP_ERR_INVALID_HANDLE",
        "is not a model (fsdp_model_t) handle this library issued",
    ),
    (
        "freed_spec",
        "FSDP_ERR_INVALID_HANDLE",
        "model declaration (fsdp_spec_t) handle that was freed",
    ),
    (
        "spec_param_undeclared_unit",
        "FSDP_ERR_INVALID_ARGUMENT",
        "unit 'nope' is not declared",
    ),
    (
        "null_out",
        "FSDP_ERR_INVALID_ARGUMENT",
        "n (the out-pointer) is NULL",
    ),
    (
        "unknown_unit",
        "FSDP_ERR_INVALID_ARGUMENT",
        "no unit named 'nope' (units: ['', '0', '1'])",
    ),
    (
        "unit_index_out_of_range",
        "FSDP_ERR_INVALID_ARGUMENT",
        "unit index 3 is out of range (the model has 3 units)",
    ),
    (
        "bad_strategy",
        "FSDP_ERR_INVALID_ARGUMENT",
        "config.sharding_strategy 42 is not an FSDP_*_SHARD value",
    ),
    (
        "bad_optimizer_kind",
        "FSDP_ERR_INVALID_ARGUMENT",
        "kind 9 is not an FSDP_OPTIM_* value",
    ),
    (
        "stream_not_null",
        "FSDP_ERR_INVALID_ARGUMENT",
        "the stream must be NULL",
    ),
    (
        "post_forward_first",
        "FSDP_ERR_USAGE",
        "fsdp_unit_post_forward on unit '1' without fsdp_unit_pre_forward first",
    ),
    (
        "post_backward_first",
        "FSDP_ERR_USAGE",
        "fsdp_unit_post_backward on unit '1' without fsdp_unit_pre_backward first",
    ),
    (
        "post_backward_first_with_grads",
        "FSDP_ERR_USAGE",
        "fsdp_unit_post_backward on unit '1' without fsdp_unit_pre_backward first",
    ),
    (
        "pre_forward_twice",
        "FSDP_ERR_USAGE",
        "fsdp_unit_pre_forward on unit '' without its fsdp_unit_post_forward",
    ),
    (
        "params_array_too_short",
        "FSDP_ERR_SHAPE_MISMATCH",
        "params: the array holds 1 DLTensors but unit '0' has 2 parameters",
    ),
    (
        "grad_wrong_shape",
        "FSDP_ERR_SHAPE_MISMATCH",
        "grads[0] ('1.weight'): shape [3, 1], expected [1, 3]",
    ),
    (
        "grad_wrong_dtype",
        "FSDP_ERR_DTYPE_MISMATCH",
        "grads[0] ('1.weight'): dtype float16, expected float32",
    ),
    (
        "grad_int_dtype",
        "FSDP_ERR_DTYPE_MISMATCH",
        "grads[0] ('1.weight'): dtype int32, expected float32",
    ),
    (
        "grad_wrong_count",
        "FSDP_ERR_SHAPE_MISMATCH",
        "grads: the array holds 2 DLTensors but unit '1' has 1 parameters",
    ),
    (
        "grad_is_fsdp_view",
        "FSDP_ERR_INVALID_ARGUMENT",
        "overlaps fsdp's own gradient view of '1.weight'",
    ),
    (
        "grad_on_cuda",
        "FSDP_ERR_DEVICE_MISMATCH",
        "grads[0] ('1.weight'): a CUDA tensor (kDLCUDA, device_id 0), but the model computes on the CPU",
    ),
    (
        "grad_cuda_negative_id",
        "FSDP_ERR_INVALID_ARGUMENT",
        "grads[0] ('1.weight'): device_id -1 of a kDLCUDA tensor is negative",
    ),
    (
        "grad_managed",
        "FSDP_ERR_UNSUPPORTED",
        "managed memory (kDLCUDAManaged) is not taken",
    ),
    (
        "config_bad_device_type",
        "FSDP_ERR_INVALID_ARGUMENT",
        "config.device {7, 0}: device_type is neither kDLCPU (1) nor kDLCUDA (2)",
    ),
    (
        "config_cpu_device_id",
        "FSDP_ERR_INVALID_ARGUMENT",
        "config.device {kDLCPU, 3}: the CPU's device_id is 0",
    ),
    (
        "grad_f16_on_bf16_model",
        "FSDP_ERR_DTYPE_MISMATCH",
        "grads[0] ('0.weight'): dtype float16, expected float32 or bfloat16",
    ),
    (
        "collective_mixed_devices",
        "FSDP_ERR_DEVICE_MISMATCH",
        "input: a CUDA tensor (kDLCUDA, device_id 0), but output is on the CPU",
    ),
    (
        "collective_host_with_stream",
        "FSDP_ERR_INVALID_ARGUMENT",
        "fsdp_all_reduce: stream 0x1: this call's tensors are on the CPU (host memory), where the stream must be NULL",
    ),
    (
        "grad_null_data",
        "FSDP_ERR_INVALID_ARGUMENT",
        "data is NULL for a tensor of 3 elements",
    ),
    (
        "grad_negative_ndim",
        "FSDP_ERR_INVALID_ARGUMENT",
        "ndim -1 is not in 0..=64",
    ),
    (
        "grad_misaligned",
        "FSDP_ERR_INVALID_ARGUMENT",
        "is not aligned to its 4-byte elements",
    ),
    (
        "pre_backward_twice",
        "FSDP_ERR_USAGE",
        "fsdp_unit_pre_backward on unit '1' without its fsdp_unit_post_backward",
    ),
    (
        "callback_stops",
        "FSDP_ERR_CALLBACK",
        "the callback returned 7 for '0.weight'",
    ),
    (
        "callback_null",
        "FSDP_ERR_INVALID_ARGUMENT",
        "callback is NULL",
    ),
    (
        "checkpoint_missing",
        "FSDP_ERR_CHECKPOINT",
        "/nonexistent/fsdp-checkpoint",
    ),
    (
        "optimizer_of_another_model",
        "FSDP_ERR_INVALID_HANDLE",
        "optimizer belongs to another model",
    ),
    (
        "all_gather_wrong_size",
        "FSDP_ERR_SHAPE_MISMATCH",
        "output has 4 elements, expected 8",
    ),
    (
        "bad_reduce_op",
        "FSDP_ERR_INVALID_ARGUMENT",
        "reduce op 99 is not an FSDP_REDUCE_* value",
    ),
    (
        "broadcast_bad_src",
        "FSDP_ERR_INVALID_ARGUMENT",
        "src 5 is not a rank of a group of 2",
    ),
    (
        "unit_after_group_destroyed",
        "FSDP_ERR_INVALID_HANDLE",
        "the process group this model was built on was destroyed",
    ),
    (
        "collective_on_destroyed_group",
        "FSDP_ERR_INVALID_HANDLE",
        "handle that was freed (or destroyed)",
    ),
    (
        "freed_model",
        "FSDP_ERR_INVALID_HANDLE",
        "model (fsdp_model_t) handle that was freed",
    ),
    (
        "unit_of_freed_model",
        "FSDP_ERR_INVALID_HANDLE",
        "unit (fsdp_unit_t) handle that was freed",
    ),
    (
        "double_free",
        "FSDP_ERR_INVALID_HANDLE",
        "fsdp_model_free: model",
    ),
    (
        "optimizer_of_freed_model",
        "FSDP_ERR_INVALID_HANDLE",
        "the optimizer's model",
    ),
    (
        "destroy_twice",
        "FSDP_ERR_INVALID_HANDLE",
        "process group (fsdp_group_t) handle that was freed",
    ),
    ("peer_left", "FSDP_ERR_PEER_FAILED", "rank 1"),
    (
        "peer_stopped_calling",
        "FSDP_ERR_TIMEOUT",
        "ranks [1] never arrived",
    ),
];

const CHECKS: &[&str] = &[
    "status_name",
    "failed_model_is_null",
    "bad_grads_changed_nothing",
    "checkpoint_round_trip",
    "abi_version",
    "config_default_on_cpu",
    "bf16_views",
    "grad_views_stay_f32",
    "bf16_grads_step",
    "f16_views",
    "all_gather",
    "reduce_scatter",
    "all_reduce_max",
    "broadcast_int32",
    "rank_and_size",
];

#[test]
fn bad_input_from_c_is_a_named_error_and_changes_nothing() {
    let exe = super::compile_c("tests/capi/abi_checks.c");
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("capi-abi-checks-ckpt");
    let _ = std::fs::remove_dir_all(&dir);
    let out = super::run(Command::new(&exe).arg(&dir));
    super::assert_report(&out, CASES, CHECKS);
}
