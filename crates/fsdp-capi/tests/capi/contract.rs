//! `tests/capi/contract.c`: the embedding contract from C, one group of checks per test,
//! each group in its own process. A parameter too big to allocate is
//! `FSDP_ERR_OUT_OF_MEMORY` naming the bytes, and the host goes on (under `RLIMIT_AS`, so
//! the allocation fails whatever the overcommit policy); shapes that overflow are refused
//! where they are declared, while a shape with a zero dimension holds no element however
//! large the others (`[0, 2^62]`, `[2^62, 2^62, 0]`) and builds. Optimizer steps, `zero_grad`, clipping and hooks at the wrong
//! time are `FSDP_ERR_USAGE` naming what was expected, change nothing, and carry nothing
//! into the next step, while gradient accumulation (with or without no_sync) still steps
//! on the exact sum. fsdp's own parameter views are refused as gradients. Ranks that
//! declared different models all fail at `fsdp_model_new`, naming the first difference
//! and both ranks, and their world stays usable. And no message that reaches C gives
//! Rust-only advice.

use std::process::Command;

/// Runs group `group` of the contract program and checks its report.
fn run_group(group: &str, cases: &[(&str, &str, &str)], checks: &[&str]) -> Vec<String> {
    let exe = super::compile_c("tests/capi/contract.c");
    let dir =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("capi-contract-{group}"));
    let _ = std::fs::remove_dir_all(&dir);
    let out = super::run(Command::new(&exe).arg(group).arg(&dir));
    let messages = super::assert_report(&out, cases, checks);
    messages.into_values().collect()
}

/// Words of the Rust API that a message reaching C must not use: C has no such item.
const RUST_ONLY: &[&str] = &[
    "FsdpConfig",
    "Module::",
    "ParamSpec",
    "Context::",
    "set_requires_gradient_sync",
    "param_init_fn",
    "hybrid_groups",
    "device_mesh",
    "pass the group as pg",
    "the optimizer's step",
    "clip_grad_norm_",
    "load_state_dict",
    "(RANK)",
    "for init (sync_module_states)",
    "a optimizer",
];

fn assert_speaks_c(messages: &[String]) {
    for m in messages {
        for w in RUST_ONLY {
            assert!(!m.contains(w), "{m:?} gives Rust-only advice ({w:?})");
        }
    }
}

#[test]
fn a_parameter_too_big_to_allocate_is_a_status_and_the_host_goes_on() {
    let m = run_group(
        "oom",
        &[
            (
                "oom_model_new",
                "FSDP_ERR_OUT_OF_MEMORY",
                // 2^40 f32 over 2 ranks: 2^39 elements, 2^41 bytes a rank.
                "fsdp_model_new: out of memory: this rank's shard of the flat parameter holding 'big.w' needs 2199023255552 bytes (2.0 TiB)",
            ),
            (
                "shape_numel_overflows",
                "FSDP_ERR_INVALID_ARGUMENT",
                "fsdp_spec_add_param: shape [4611686018427387904, 4]: its element count overflows the address space (64 bits)",
            ),
            (
                "shape_bytes_overflow",
                "FSDP_ERR_INVALID_ARGUMENT",
                "fsdp_spec_add_param_init: shape [4611686018427387904]: its size in bytes overflows",
            ),
            // Zero elements, however large the other dimensions.
            ("zero_numel_huge_dim", "FSDP_OK", ""),
            ("zero_numel_after_overflow", "FSDP_OK", ""),
            ("zero_numel_null_values", "FSDP_OK", ""),
            ("zero_numel_model_new", "FSDP_OK", ""),
        ],
        &["oom_model_is_null", "zero_numel_state_dict", "trains_after_oom"],
    );
    assert_speaks_c(&m);
}

#[test]
fn steps_and_hooks_out_of_order_are_refused_and_nothing_is_carried_over() {
    let unfinished = "the backward ended (the root's fsdp_unit_post_backward) but its gradient reductions were neither waited for nor added to the sharded gradients; call fsdp_model_finish_backward first";
    let m = run_group(
        "order",
        &[
            (
                "step_before_any_backward",
                "FSDP_ERR_USAGE",
                "fsdp_optimizer_step without gradients: no backward finished since fsdp_model_zero_grad (or since the model was built); run a forward and a backward, ended by fsdp_model_finish_backward, first",
            ),
            (
                "finish_without_backward",
                "FSDP_ERR_USAGE",
                "fsdp_model_finish_backward without a backward: it ends the backward the root's fsdp_unit_pre_backward began",
            ),
            (
                "backward_without_forward",
                "FSDP_ERR_NO_SAVED_FORWARD",
                "fsdp_unit_pre_backward: FSDP root: backward called without a saved forward",
            ),
            (
                "backward_after_no_grad_forward",
                "FSDP_ERR_NO_SAVED_FORWARD",
                "fsdp_unit_pre_backward: FSDP root: backward called without a saved forward",
            ),
            (
                "nested_forward_outside_root",
                "FSDP_ERR_USAGE",
                "fsdp_unit_pre_forward on unit '1' outside the root's forward: the root's fsdp_unit_pre_forward comes first and its fsdp_unit_post_forward last",
            ),
            (
                "step_after_failed_backward",
                "FSDP_ERR_USAGE",
                "fsdp_optimizer_step after a failed backward (the backward of unit '1' failed (fsdp_unit_post_backward was told it did not succeed)): the gradients held since fsdp_model_zero_grad are incomplete",
            ),
            (
                "step_without_finish",
                "FSDP_ERR_USAGE",
                &format!("fsdp_optimizer_step before fsdp_model_finish_backward: {unfinished}"),
            ),
            (
                "zero_grad_without_finish",
                "FSDP_ERR_USAGE",
                &format!("fsdp_model_zero_grad before fsdp_model_finish_backward: {unfinished}"),
            ),
            (
                "clip_without_finish",
                "FSDP_ERR_USAGE",
                "fsdp_model_clip_grad_norm before fsdp_model_finish_backward",
            ),
            (
                "forward_without_finish",
                "FSDP_ERR_USAGE",
                "fsdp_unit_pre_forward on unit '' before fsdp_model_finish_backward",
            ),
            (
                "backward_without_finish",
                "FSDP_ERR_USAGE",
                "fsdp_unit_pre_backward on unit '' before fsdp_model_finish_backward",
            ),
            (
                "unit_backward_without_finish",
                "FSDP_ERR_USAGE",
                "fsdp_unit_pre_backward on unit '1' before fsdp_model_finish_backward",
            ),
            (
                "step_after_zero_grad",
                "FSDP_ERR_USAGE",
                "fsdp_optimizer_step without gradients",
            ),
            (
                "step_between_forward_and_backward",
                "FSDP_ERR_USAGE",
                "fsdp_optimizer_step between a forward and its backward",
            ),
            (
                "unit_backward_outside_root",
                "FSDP_ERR_USAGE",
                "fsdp_unit_pre_backward on unit '1' outside the root's backward: the root's fsdp_unit_pre_backward comes first and its fsdp_unit_post_backward last",
            ),
            (
                "step_mid_backward",
                "FSDP_ERR_USAGE",
                "fsdp_optimizer_step in the middle of a backward (between the root's fsdp_unit_pre_backward and fsdp_unit_post_backward)",
            ),
            (
                "finish_mid_backward",
                "FSDP_ERR_USAGE",
                "fsdp_model_finish_backward before the root's fsdp_unit_post_backward",
            ),
            (
                "root_post_backward_before_unit",
                "FSDP_ERR_USAGE",
                "fsdp_unit_post_backward on the root while unit(s) '0' are still inside",
            ),
            (
                "step_with_unreduced_grads",
                "FSDP_ERR_USAGE",
                "fsdp_optimizer_step while gradients are kept unreduced under no_sync (fsdp_model_set_no_sync(model, 1)) in unit(s) '0', '1': the step would skip them; turn synchronization back on (fsdp_model_set_no_sync(model, 0))",
            ),
        ],
        &[
            "refused_calls_changed_nothing",
            "nothing_carried_over",
            "failed_backward_changed_nothing",
            "accumulation",
            "no_sync_accumulation",
            "zero_grad_drops_no_sync_grads",
        ],
    );
    assert_speaks_c(&m);
}

#[test]
fn fsdp_parameter_views_are_not_taken_as_gradients() {
    let m = run_group(
        "views",
        &[
            (
                "param_view_as_grad",
                "FSDP_ERR_INVALID_ARGUMENT",
                "fsdp_unit_post_backward: grads[0] ('0.w'): the gradient's memory overlaps fsdp's own parameter view of '0.w' (the params of fsdp_unit_pre_backward)",
            ),
            (
                "bf16_param_view_as_grad",
                "FSDP_ERR_INVALID_ARGUMENT",
                "grads[0] ('0.w'): the gradient's memory overlaps fsdp's own parameter view of '0.w'",
            ),
        ],
        &["refused_view_changed_nothing"],
    );
    assert_speaks_c(&m);
}

#[test]
fn ranks_that_declare_different_models_all_fail_at_fsdp_model_new() {
    let m = run_group(
        "mismatch",
        &[
            (
                "transposed_shape",
                "FSDP_ERR_COLLECTIVE_MISMATCH",
                "fsdp_model_new: collective mismatch in group of 2 ranks: the ranks declared different models or configurations: rank 1 declared unit 'layer1' parameter 'weight' with shape [3, 2], rank 0 with shape [2, 3]; every rank passes the same configuration and declares the same units and parameters",
            ),
            (
                "units_in_another_order",
                "FSDP_ERR_COLLECTIVE_MISMATCH",
                "the ranks declared different models or configurations: declaration 0: rank 1 declared unit 'layer1', rank 0 unit 'layer0'",
            ),
            (
                "frozen_on_one_rank",
                "FSDP_ERR_COLLECTIVE_MISMATCH",
                "rank 1 declared unit 'layer1' parameter 'weight' frozen, rank 0 trainable",
            ),
            (
                "strategy_on_one_rank",
                "FSDP_ERR_COLLECTIVE_MISMATCH",
                "rank 1 passed fsdp_config.sharding_strategy = FSDP_HYBRID_SHARD, rank 0 fsdp_config.sharding_strategy = FSDP_FULL_SHARD",
            ),
            (
                "precision_on_one_rank",
                "FSDP_ERR_COLLECTIVE_MISMATCH",
                "rank 1 passed fsdp_config.mixed_precision = FSDP_PRECISION_BF16, rank 0 fsdp_config.mixed_precision = FSDP_PRECISION_F32",
            ),
            (
                "sync_module_states_on_one_rank",
                "FSDP_ERR_COLLECTIVE_MISMATCH",
                "rank 1 passed fsdp_config.sync_module_states = false, rank 0 fsdp_config.sync_module_states = true",
            ),
        ],
        &["every_rank_refused", "world_usable_after_mismatch"],
    );
    assert_speaks_c(&m);
}

#[test]
fn errors_that_reach_c_name_the_header_fields_and_functions() {
    let m = run_group(
        "words",
        &[
            (
                "hybrid_without_ranks_per_node",
                "FSDP_ERR_USAGE",
                "FSDP_HYBRID_SHARD needs to know which ranks share a node: set fsdp_config.ranks_per_node",
            ),
            (
                "ranks_per_node_not_dividing",
                "FSDP_ERR_INVALID_ARGUMENT",
                "fsdp_config.ranks_per_node 3 must divide the world size 2",
            ),
            (
                "ranks_per_node_without_hybrid",
                "FSDP_ERR_USAGE",
                "fsdp_config.ranks_per_node is for FSDP_HYBRID_SHARD and FSDP_HYBRID_SHARD_ZERO2; with FSDP_FULL_SHARD leave fsdp_config.ranks_per_node 0",
            ),
            (
                "no_parameters",
                "FSDP_ERR_INVALID_ARGUMENT",
                "the declaration has no parameters (1 units, none with a parameter): there is nothing to shard or train; declare them with fsdp_spec_add_param or fsdp_spec_add_param_init",
            ),
            (
                "values_missing",
                "FSDP_ERR_INVALID_ARGUMENT",
                "parameter '0.w' has no values on this rank (values NULL in fsdp_spec_add_param) and nothing gives it any: pass values, use fsdp_spec_add_param_init, or set fsdp_config.sync_module_states",
            ),
            (
                "values_missing_on_every_rank",
                "FSDP_ERR_NOT_MATERIALIZED",
                "parameter '0.w' is not materialized (state: declared without values on every rank (values NULL in fsdp_spec_add_param); give rank 0 values with fsdp_config.sync_module_states, or use fsdp_spec_add_param_init)",
            ),
            (
                "adamw_beta_at_new",
                "FSDP_ERR_INVALID_ARGUMENT",
                "fsdp_optimizer_new: invalid argument: AdamW: beta1 1.5 must be in [0, 1)",
            ),
            (
                "sgd_lr_at_new",
                "FSDP_ERR_INVALID_ARGUMENT",
                "fsdp_optimizer_new: invalid argument: SGD: lr -1 must be finite and >= 0",
            ),
            (
                "load_between_forward_and_backward",
                "FSDP_ERR_USAGE",
                "between a forward and its backward: the pending backward would compute gradients for parameters other than those the forward used; call it before the forward or after the backward (a forward with grad_enabled 0 (fsdp_unit_pre_forward) leaves nothing pending)",
            ),
        ],
        &[],
    );
    assert_speaks_c(&m);
}
