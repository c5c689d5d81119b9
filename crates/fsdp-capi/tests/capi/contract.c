/*
 * The embedding contract from C: calls that would train wrong are refused with a status
 * and a message naming what was expected, in the header's own names. Ranks are threads
 * (world 2). One group of checks per run, each in its own process:
 *
 *   oom       a parameter too big to allocate, a shape that overflows (under RLIMIT_AS),
 *             zero-element shapes with huge dimensions (accepted)
 *   order     optimizer steps, zero_grad and hooks at the wrong time; gradient accumulation
 *   views     fsdp's own parameter views passed back as gradients
 *   mismatch  ranks that declared different models
 *   words     messages that reach C name the header's fields and functions
 *
 * Prints "CASE <name> <status> <message>" for each call expected to fail (rank 0's) and
 * "CHECK <name> ok|FAIL <detail>" for each value checked; tests/capi/contract.rs asserts
 * them.
 *
 * usage: contract GROUP SCRATCH_DIR
 */
#include "report.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

static const char *scratch;

/* Rank 1's status of the last call `expect` recorded under each name, for the checks
 * that every rank got the error. */
static fsdp_status rank1_status[8];

static fsdp_config config(int32_t strategy, int32_t precision) {
    fsdp_config c;
    MUST(fsdp_config_default(&c));
    c.sharding_strategy = strategy;
    c.mixed_precision = precision;
    return c;
}

/* Units "0" and "1", each one parameter "w" of shape [2]: w0 = (1, 2), w1 = (3, 4). */
static fsdp_status build(fsdp_group_t g, int32_t precision, fsdp_model_t *out) {
    fsdp_spec_t spec;
    MUST(fsdp_spec_new(&spec));
    float w0[2] = {1, 2}, w1[2] = {3, 4};
    int64_t s2[1] = {2};
    MUST(fsdp_spec_add_unit(spec, "0"));
    MUST(fsdp_spec_add_unit(spec, "1"));
    MUST(fsdp_spec_add_param(spec, "0", "w", 1, s2, w0, true));
    MUST(fsdp_spec_add_param(spec, "1", "w", 1, s2, w1, true));
    fsdp_config c = config(FSDP_FULL_SHARD, precision);
    fsdp_status s = fsdp_model_new(g, spec, &c, out);
    MUST(fsdp_spec_free(spec));
    return s;
}

static fsdp_optimizer_t sgd(fsdp_model_t m) {
    fsdp_optimizer_config oc;
    MUST(fsdp_optimizer_config_default(FSDP_OPTIM_SGD, &oc));
    oc.lr = 0.5f;
    fsdp_optimizer_t o;
    MUST(fsdp_optimizer_new(m, &oc, &o));
    return o;
}

typedef struct {
    fsdp_unit_t root, u0, u1;
} Units;

static Units units_of(fsdp_model_t m) {
    Units u;
    MUST(fsdp_model_unit_at(m, 0, &u.root));
    MUST(fsdp_model_unit(m, "0", &u.u0));
    MUST(fsdp_model_unit(m, "1", &u.u1));
    return u;
}

/* The input of micro-batch k on `rank`: loss = w0 . x + w1 . x, so d loss / d w = x for
 * both units, and the gradient averaged over the two ranks is (1.5, 0.5 (k + 1)). */
static void input(int rank, int k, float x[2]) {
    x[0] = (float)(rank + 1);
    x[1] = 0.5f * (float)(k + 1);
}

static void forward_with(Units u, bool grad) {
    MUST(fsdp_unit_pre_forward(u.root, grad, NULL, 0, NULL));
    MUST(fsdp_unit_pre_forward(u.u0, grad, NULL, 0, NULL));
    MUST(fsdp_unit_post_forward(u.u0, true, NULL));
    MUST(fsdp_unit_pre_forward(u.u1, grad, NULL, 0, NULL));
    MUST(fsdp_unit_post_forward(u.u1, true, NULL));
    MUST(fsdp_unit_post_forward(u.root, true, NULL));
}

static void forward(Units u) { forward_with(u, true); }

/* Adds x into one unit's gradient view, between its pre_backward and post_backward. */
static void unit_backward(fsdp_unit_t unit, const float x[2]) {
    DLTensor g[1];
    MUST(fsdp_unit_pre_backward(unit, NULL, g, 1, NULL));
    float *d = g[0].data;
    d[0] += x[0];
    d[1] += x[1];
    MUST(fsdp_unit_post_backward(unit, NULL, 0, true, NULL));
}

/* A micro-batch's forward and backward, the root's post_backward included, without
 * fsdp_model_finish_backward. */
static void micro_batch(Units u, int rank, int k) {
    float x[2];
    input(rank, k, x);
    forward(u);
    MUST(fsdp_unit_pre_backward(u.root, NULL, NULL, 0, NULL));
    unit_backward(u.u1, x);
    unit_backward(u.u0, x);
    MUST(fsdp_unit_post_backward(u.root, NULL, 0, true, NULL));
}

typedef struct {
    float v[4];
    int n;
} Flat;

static int32_t flatten(void *ctx, const char *name, const DLTensor *t) {
    (void)name;
    Flat *f = (Flat *)ctx;
    const float *d = (const float *)t->data;
    for (int64_t i = 0; i < t->shape[0] && f->n < 4; i++) f->v[f->n++] = d[i];
    return 0;
}

/* Whether the model's parameters are w0 = (a, b), w1 = (a + 2, b + 2) exactly. */
static int params_are(fsdp_model_t m, float a, float b, char *detail, size_t len) {
    Flat f = {{0}, 0};
    MUST(fsdp_model_full_state_dict(m, false, flatten, &f, NULL));
    snprintf(detail, len, "w0 (%.9g, %.9g) w1 (%.9g, %.9g), want w0 (%.9g, %.9g)", f.v[0],
             f.v[1], f.v[2], f.v[3], a, b);
    return f.n == 4 && f.v[0] == a && f.v[1] == b && f.v[2] == a + 2 && f.v[3] == b + 2;
}

/* ---- oom: allocation failure is a status, never an abort ---------------------------- */

/* The state dict's entries as "name [d0, d1, ...]; ..." (the shapes as the DLTensors give
 * them). */
typedef struct {
    char text[256];
} Shapes;

static int32_t shapes_of(void *ctx, const char *name, const DLTensor *t) {
    Shapes *s = (Shapes *)ctx;
    size_t n = strlen(s->text);
    n += snprintf(s->text + n, sizeof s->text - n, "%s%s [", n ? "; " : "", name);
    for (int32_t d = 0; d < t->ndim && n < sizeof s->text; d++)
        n += snprintf(s->text + n, sizeof s->text - n, "%s%lld", d ? ", " : "",
                      (long long)t->shape[d]);
    if (n < sizeof s->text) snprintf(s->text + n, sizeof s->text - n, "]");
    return 0;
}

static void *oom_checks(void *arg) {
    int rank = *(int *)arg;
    fsdp_group_t world = join("threads://contract-oom", rank, 2, 30000);
    fsdp_spec_t spec;
    MUST(fsdp_spec_new(&spec));
    MUST(fsdp_spec_add_unit(spec, "big"));
    /* 2^40 floats: 4 TiB, 2 TiB a rank; no overflow, but no memory holds it. */
    int64_t huge[1] = {(int64_t)1 << 40};
    MUST(fsdp_spec_add_param_init(spec, "big", "w", 1, huge, FSDP_INIT_CONSTANT, 0, 1.0f, true));
    fsdp_model_t m = {0};
    report(rank, "oom_model_new", fsdp_model_new(world, spec, NULL, &m));
    check(rank, "oom_model_is_null", m.id == 0, "");
    MUST(fsdp_spec_free(spec));
    /* Shapes no size_t holds are refused where they are declared. */
    MUST(fsdp_spec_new(&spec));
    MUST(fsdp_spec_add_unit(spec, "big"));
    int64_t numel_overflows[2] = {(int64_t)1 << 62, 4};
    report(rank, "shape_numel_overflows",
           fsdp_spec_add_param(spec, "big", "w", 2, numel_overflows, NULL, true));
    int64_t bytes_overflow[1] = {(int64_t)1 << 62};
    report(rank, "shape_bytes_overflow",
           fsdp_spec_add_param_init(spec, "big", "w", 1, bytes_overflow, FSDP_INIT_UNIFORM, 0,
                                    1.0f, true));
    MUST(fsdp_spec_free(spec));
    /* A shape with a zero dimension holds no element, however large the others, even when
     * their product alone overflows: accepted, built, and in the state dict as declared. */
    MUST(fsdp_spec_new(&spec));
    MUST(fsdp_spec_add_unit(spec, "empty"));
    int64_t zero_then_huge[2] = {0, (int64_t)1 << 62};
    int64_t huge_then_zero[3] = {(int64_t)1 << 62, (int64_t)1 << 62, 0};
    float w[2] = {1, 2};
    /* Values for 0 elements: a valid pointer, never read. */
    report(rank, "zero_numel_huge_dim",
           fsdp_spec_add_param(spec, "empty", "a", 2, zero_then_huge, w, true));
    report(rank, "zero_numel_after_overflow",
           fsdp_spec_add_param_init(spec, "empty", "b", 3, huge_then_zero, FSDP_INIT_UNIFORM,
                                    0, 1.0f, true));
    /* Values NULL for 0 elements: nothing to miss, no sync_module_states needed. */
    int64_t zero[1] = {0};
    report(rank, "zero_numel_null_values",
           fsdp_spec_add_param(spec, "empty", "c", 1, zero, NULL, true));
    int64_t s2[1] = {2};
    MUST(fsdp_spec_add_param(spec, "empty", "w", 1, s2, w, true));
    report(rank, "zero_numel_model_new", fsdp_model_new(world, spec, NULL, &m));
    MUST(fsdp_spec_free(spec));
    Shapes shapes = {{0}};
    if (m.id != 0) {
        MUST(fsdp_model_full_state_dict(m, false, shapes_of, &shapes, NULL));
        MUST(fsdp_model_free(m));
    }
    check(rank, "zero_numel_state_dict",
          !strcmp(shapes.text, "empty.a [0, 4611686018427387904]; "
                               "empty.b [4611686018427387904, 4611686018427387904, 0]; "
                               "empty.c [0]; empty.w [2]"),
          shapes.text);
    /* The host goes on: a normal model builds and trains. */
    MUST(build(world, FSDP_PRECISION_F32, &m));
    fsdp_optimizer_t o = sgd(m);
    Units u = units_of(m);
    micro_batch(u, rank, 0);
    MUST(fsdp_model_finish_backward(m, NULL));
    MUST(fsdp_optimizer_step(o, NULL));
    char detail[160];
    /* w0 - 0.5 (1.5, 0.5) */
    check(rank, "trains_after_oom", params_are(m, 0.25f, 1.75f, detail, sizeof detail), detail);
    MUST(fsdp_optimizer_free(o));
    MUST(fsdp_model_free(m));
    MUST(fsdp_destroy_process_group(world));
    return NULL;
}

/* ---- order: steps, zero_grad and hooks at the wrong time ----------------------------- */

static void *order_checks(void *arg) {
    int rank = *(int *)arg;
    fsdp_group_t world = join("threads://contract-order", rank, 2, 30000);
    fsdp_model_t m;
    MUST(build(world, FSDP_PRECISION_F32, &m));
    fsdp_optimizer_t o = sgd(m);
    Units u = units_of(m);
    char detail[160];

    report(rank, "step_before_any_backward", fsdp_optimizer_step(o, NULL));
    report(rank, "finish_without_backward", fsdp_model_finish_backward(m, NULL));
    /* A backward needs a forward with grad before it; a nested unit's forward needs the
     * root's around it. */
    report(rank, "backward_without_forward", fsdp_unit_pre_backward(u.root, NULL, NULL, 0, NULL));
    forward_with(u, false);
    report(rank, "backward_after_no_grad_forward",
           fsdp_unit_pre_backward(u.root, NULL, NULL, 0, NULL));
    report(rank, "nested_forward_outside_root", fsdp_unit_pre_forward(u.u1, true, NULL, 0, NULL));

    /* The root's post_backward without fsdp_model_finish_backward: everything that
     * would drop or carry its gradients is refused. */
    micro_batch(u, rank, 0);
    report(rank, "step_without_finish", fsdp_optimizer_step(o, NULL));
    report(rank, "zero_grad_without_finish", fsdp_model_zero_grad(m));
    report(rank, "clip_without_finish", fsdp_model_clip_grad_norm(m, 1.0f, 2.0f, NULL, NULL));
    report(rank, "forward_without_finish", fsdp_unit_pre_forward(u.root, true, NULL, 0, NULL));
    report(rank, "backward_without_finish", fsdp_unit_pre_backward(u.root, NULL, NULL, 0, NULL));
    report(rank, "unit_backward_without_finish",
           fsdp_unit_pre_backward(u.u1, NULL, NULL, 0, NULL));
    MUST(fsdp_model_finish_backward(m, NULL));
    check(rank, "refused_calls_changed_nothing", params_are(m, 1, 2, detail, sizeof detail),
          detail);
    MUST(fsdp_optimizer_step(o, NULL));
    MUST(fsdp_model_zero_grad(m));
    report(rank, "step_after_zero_grad", fsdp_optimizer_step(o, NULL));
    /* The next step gets its own gradient only: w - 0.5 (1.5, 0.5) - 0.5 (1.5, 1). */
    micro_batch(u, rank, 1);
    MUST(fsdp_model_finish_backward(m, NULL));
    MUST(fsdp_optimizer_step(o, NULL));
    MUST(fsdp_model_zero_grad(m));
    check(rank, "nothing_carried_over", params_are(m, -0.5f, 1.25f, detail, sizeof detail),
          detail);

    /* A backward that failed in unit 1 (the host says so): its gradients are incomplete,
     * and no step may apply them until zero_grad. */
    float xf[2];
    input(rank, 0, xf);
    forward(u);
    MUST(fsdp_unit_pre_backward(u.root, NULL, NULL, 0, NULL));
    DLTensor gf[1];
    MUST(fsdp_unit_pre_backward(u.u1, NULL, gf, 1, NULL));
    MUST(fsdp_unit_post_backward(u.u1, NULL, 0, false, NULL));
    unit_backward(u.u0, xf);
    MUST(fsdp_unit_post_backward(u.root, NULL, 0, true, NULL));
    MUST(fsdp_model_finish_backward(m, NULL));
    report(rank, "step_after_failed_backward", fsdp_optimizer_step(o, NULL));
    MUST(fsdp_model_zero_grad(m));
    check(rank, "failed_backward_changed_nothing",
          params_are(m, -0.5f, 1.25f, detail, sizeof detail), detail);

    /* A step, or the end, in the middle of a backward. */
    float x[2];
    input(rank, 0, x);
    forward(u);
    report(rank, "step_between_forward_and_backward", fsdp_optimizer_step(o, NULL));
    report(rank, "unit_backward_outside_root", fsdp_unit_pre_backward(u.u1, NULL, NULL, 0, NULL));
    MUST(fsdp_unit_pre_backward(u.root, NULL, NULL, 0, NULL));
    unit_backward(u.u1, x);
    report(rank, "step_mid_backward", fsdp_optimizer_step(o, NULL));
    report(rank, "finish_mid_backward", fsdp_model_finish_backward(m, NULL));
    DLTensor g[1];
    MUST(fsdp_unit_pre_backward(u.u0, NULL, g, 1, NULL));
    ((float *)g[0].data)[0] += x[0];
    ((float *)g[0].data)[1] += x[1];
    report(rank, "root_post_backward_before_unit",
           fsdp_unit_post_backward(u.root, NULL, 0, true, NULL));
    MUST(fsdp_unit_post_backward(u.u0, NULL, 0, true, NULL));
    MUST(fsdp_unit_post_backward(u.root, NULL, 0, true, NULL));
    MUST(fsdp_model_finish_backward(m, NULL));
    MUST(fsdp_model_zero_grad(m));

    /* Gradient accumulation stays legal: two backwards, each finished, then one step
     * on their sum; and under no_sync, the step waits for the synchronized backward. */
    fsdp_model_t a, b;
    MUST(build(world, FSDP_PRECISION_F32, &a));
    MUST(build(world, FSDP_PRECISION_F32, &b));
    fsdp_optimizer_t oa = sgd(a), ob = sgd(b);
    Units ua = units_of(a), ub = units_of(b);
    for (int k = 0; k < 2; k++) {
        micro_batch(ua, rank, k);
        MUST(fsdp_model_finish_backward(a, NULL));
    }
    MUST(fsdp_optimizer_step(oa, NULL));
    check(rank, "accumulation", params_are(a, -0.5f, 1.25f, detail, sizeof detail), detail);
    MUST(fsdp_model_set_no_sync(b, true));
    micro_batch(ub, rank, 0);
    MUST(fsdp_model_finish_backward(b, NULL));
    report(rank, "step_with_unreduced_grads", fsdp_optimizer_step(ob, NULL));
    MUST(fsdp_model_set_no_sync(b, false));
    micro_batch(ub, rank, 1);
    MUST(fsdp_model_finish_backward(b, NULL));
    MUST(fsdp_optimizer_step(ob, NULL));
    check(rank, "no_sync_accumulation", params_are(b, -0.5f, 1.25f, detail, sizeof detail),
          detail);
    /* zero_grad drops what no_sync kept: the next step sees its own gradient only. */
    MUST(fsdp_model_zero_grad(b));
    MUST(fsdp_model_set_no_sync(b, true));
    micro_batch(ub, rank, 0);
    MUST(fsdp_model_finish_backward(b, NULL));
    MUST(fsdp_model_zero_grad(b));
    MUST(fsdp_model_set_no_sync(b, false));
    micro_batch(ub, rank, 0);
    MUST(fsdp_model_finish_backward(b, NULL));
    MUST(fsdp_optimizer_step(ob, NULL));
    check(rank, "zero_grad_drops_no_sync_grads",
          params_are(b, -1.25f, 1.0f, detail, sizeof detail), detail);

    MUST(fsdp_optimizer_free(oa));
    MUST(fsdp_optimizer_free(ob));
    MUST(fsdp_model_free(a));
    MUST(fsdp_model_free(b));
    MUST(fsdp_optimizer_free(o));
    MUST(fsdp_model_free(m));
    MUST(fsdp_destroy_process_group(world));
    return NULL;
}

/* ---- views: fsdp's parameter views are not gradients ---------------------------------- */

static void views_on(int rank, fsdp_group_t world, int32_t precision, const char *name) {
    fsdp_model_t m;
    MUST(build(world, precision, &m));
    fsdp_optimizer_t o = sgd(m);
    Units u = units_of(m);
    float x[2];
    input(rank, 0, x);
    forward(u);
    MUST(fsdp_unit_pre_backward(u.root, NULL, NULL, 0, NULL));
    unit_backward(u.u1, x);
    DLTensor p[1], g[1];
    MUST(fsdp_unit_pre_backward(u.u0, p, g, 1, NULL));
    report(rank, name, fsdp_unit_post_backward(u.u0, p, 1, true, NULL));
    /* Refused before anything was added: the unit is still in its backward. */
    float mine[2] = {x[0], x[1]};
    int64_t s2[1] = {2};
    DLTensor t = {mine, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, s2, NULL, 0};
    MUST(fsdp_unit_post_backward(u.u0, &t, 1, true, NULL));
    MUST(fsdp_unit_post_backward(u.root, NULL, 0, true, NULL));
    MUST(fsdp_model_finish_backward(m, NULL));
    MUST(fsdp_optimizer_step(o, NULL));
    if (precision == FSDP_PRECISION_F32) {
        char detail[160];
        check(rank, "refused_view_changed_nothing",
              params_are(m, 0.25f, 1.75f, detail, sizeof detail), detail);
    }
    MUST(fsdp_optimizer_free(o));
    MUST(fsdp_model_free(m));
}

static void *views_checks(void *arg) {
    int rank = *(int *)arg;
    fsdp_group_t world = join("threads://contract-views", rank, 2, 30000);
    views_on(rank, world, FSDP_PRECISION_F32, "param_view_as_grad");
    views_on(rank, world, FSDP_PRECISION_BF16, "bf16_param_view_as_grad");
    MUST(fsdp_destroy_process_group(world));
    return NULL;
}

/* ---- mismatch: every rank declares the same model ---------------------------------------- */

/* Unit "layer0" (weight [4]) and "layer1" (weight of `shape`, frozen unless `trains`), in
 * the order `swap` says. */
static fsdp_status declare_with(fsdp_group_t g, int64_t rows, int64_t cols, int swap, bool trains,
                                const fsdp_config *c, fsdp_model_t *out) {
    fsdp_spec_t spec;
    MUST(fsdp_spec_new(&spec));
    const char *first = swap ? "layer1" : "layer0", *second = swap ? "layer0" : "layer1";
    MUST(fsdp_spec_add_unit(spec, first));
    MUST(fsdp_spec_add_unit(spec, second));
    int64_t s4[1] = {4}, s[2] = {rows, cols};
    MUST(fsdp_spec_add_param_init(spec, "layer0", "weight", 1, s4, FSDP_INIT_CONSTANT, 0, 1, true));
    MUST(fsdp_spec_add_param_init(spec, "layer1", "weight", 2, s, FSDP_INIT_CONSTANT, 0, 1, trains));
    fsdp_status st = fsdp_model_new(g, spec, c, out);
    MUST(fsdp_spec_free(spec));
    return st;
}

static fsdp_status declare(fsdp_group_t g, int64_t rows, int64_t cols, int swap, bool trains,
                           fsdp_model_t *out) {
    return declare_with(g, rows, cols, swap, trains, NULL, out);
}

static void expect_everywhere(int rank, int slot, const char *name, fsdp_status s) {
    report(rank, name, s);
    if (rank == 1) rank1_status[slot] = s;
}

static void *mismatch_checks(void *arg) {
    int rank = *(int *)arg;
    fsdp_group_t world = join("threads://contract-mismatch", rank, 2, 30000);
    fsdp_model_t m = {0};
    /* The same element count, transposed on rank 1. */
    expect_everywhere(rank, 0, "transposed_shape",
                      declare(world, rank == 0 ? 2 : 3, rank == 0 ? 3 : 2, 0, true, &m));
    expect_everywhere(rank, 1, "units_in_another_order", declare(world, 2, 3, rank, true, &m));
    expect_everywhere(rank, 2, "frozen_on_one_rank", declare(world, 2, 3, 0, rank == 0, &m));
    /* The same model under another configuration on rank 1: a hybrid rank beside a
     * full-shard one would wait for a node group that never forms. */
    fsdp_config c = config(FSDP_FULL_SHARD, FSDP_PRECISION_F32);
    if (rank == 1) {
        c.sharding_strategy = FSDP_HYBRID_SHARD;
        c.ranks_per_node = 1;
    }
    expect_everywhere(rank, 3, "strategy_on_one_rank", declare_with(world, 2, 3, 0, true, &c, &m));
    c = config(FSDP_FULL_SHARD, rank == 1 ? FSDP_PRECISION_BF16 : FSDP_PRECISION_F32);
    expect_everywhere(rank, 4, "precision_on_one_rank", declare_with(world, 2, 3, 0, true, &c, &m));
    c = config(FSDP_FULL_SHARD, FSDP_PRECISION_F32);
    c.sync_module_states = rank == 0;
    expect_everywhere(rank, 5, "sync_module_states_on_one_rank",
                      declare_with(world, 2, 3, 0, true, &c, &m));
    MUST(fsdp_barrier(world)); /* rank 1's statuses are recorded */
    char detail[160];
    bool all = m.id == 0;
    int used = snprintf(detail, sizeof detail, "rank 1:");
    for (int i = 0; i < 6; i++) {
        all = all && rank1_status[i] == FSDP_ERR_COLLECTIVE_MISMATCH;
        used += snprintf(detail + used, sizeof detail - (size_t)used, " %s",
                         fsdp_status_name(rank1_status[i]));
    }
    check(rank, "every_rank_refused", all, detail);
    /* The world is still usable: the same declaration builds and gathers. */
    MUST(declare(world, 2, 3, 0, true, &m));
    Flat f = {{0}, 0};
    MUST(fsdp_model_full_state_dict(m, false, flatten, &f, NULL));
    check(rank, "world_usable_after_mismatch", f.n == 4 && f.v[0] == 1.0f, "");
    MUST(fsdp_model_free(m));
    MUST(fsdp_destroy_process_group(world));
    return NULL;
}

/* ---- words: what reaches C names the header's fields and functions -------------------- */

static void *words_checks(void *arg) {
    int rank = *(int *)arg;
    fsdp_group_t world = join("threads://contract-words", rank, 2, 30000);
    fsdp_spec_t spec;
    fsdp_model_t m = {0};
    MUST(fsdp_spec_new(&spec));
    MUST(fsdp_spec_add_unit(spec, "0"));
    float w[2] = {1, 2};
    int64_t s2[1] = {2};
    MUST(fsdp_spec_add_param(spec, "0", "w", 1, s2, w, true));
    fsdp_config c = config(FSDP_HYBRID_SHARD, FSDP_PRECISION_F32);
    report(rank, "hybrid_without_ranks_per_node", fsdp_model_new(world, spec, &c, &m));
    c.ranks_per_node = 3;
    report(rank, "ranks_per_node_not_dividing", fsdp_model_new(world, spec, &c, &m));
    c = config(FSDP_FULL_SHARD, FSDP_PRECISION_F32);
    c.ranks_per_node = 2;
    report(rank, "ranks_per_node_without_hybrid", fsdp_model_new(world, spec, &c, &m));
    MUST(fsdp_spec_free(spec));

    MUST(fsdp_spec_new(&spec));
    MUST(fsdp_spec_add_unit(spec, "0"));
    report(rank, "no_parameters", fsdp_model_new(world, spec, NULL, &m));
    MUST(fsdp_spec_add_param(spec, "0", "w", 1, s2, NULL, true));
    report(rank, "values_missing", fsdp_model_new(world, spec, NULL, &m));
    c = config(FSDP_FULL_SHARD, FSDP_PRECISION_F32);
    c.sync_module_states = true;
    report(rank, "values_missing_on_every_rank", fsdp_model_new(world, spec, &c, &m));
    MUST(fsdp_spec_free(spec));

    /* A checkpoint loaded between a forward and its backward. */
    MUST(build(world, FSDP_PRECISION_F32, &m));
    /* Hyperparameters are checked when the optimizer is made, not at its first step. */
    fsdp_optimizer_config oc;
    fsdp_optimizer_t bad = {0};
    MUST(fsdp_optimizer_config_default(FSDP_OPTIM_ADAMW, &oc));
    oc.beta1 = 1.5f;
    report(rank, "adamw_beta_at_new", fsdp_optimizer_new(m, &oc, &bad));
    MUST(fsdp_optimizer_config_default(FSDP_OPTIM_SGD, &oc));
    oc.lr = -1.0f;
    report(rank, "sgd_lr_at_new", fsdp_optimizer_new(m, &oc, &bad));
    fsdp_optimizer_t o = sgd(m);
    MUST(fsdp_checkpoint_save(m, o, scratch, FSDP_CHECKPOINT_SHARDED, NULL));
    Units u = units_of(m);
    forward(u);
    report(rank, "load_between_forward_and_backward", fsdp_checkpoint_load(m, o, scratch, NULL));
    MUST(fsdp_optimizer_free(o));
    MUST(fsdp_model_free(m));
    MUST(fsdp_destroy_process_group(world));
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    const char *group = argv[1];
    scratch = argv[2];
    if (!strcmp(group, "oom")) {
        /* A ceiling on this process's address space: the 2 TiB shard fails to allocate
         * whatever the machine's overcommit policy, and nothing of that size is touched. */
        struct rlimit r = {(rlim_t)64 << 30, (rlim_t)64 << 30};
        if (setrlimit(RLIMIT_AS, &r) != 0) return 3;
        run2(oom_checks);
    } else if (!strcmp(group, "order")) {
        run2(order_checks);
    } else if (!strcmp(group, "views")) {
        run2(views_checks);
    } else if (!strcmp(group, "mismatch")) {
        run2(mismatch_checks);
    } else if (!strcmp(group, "words")) {
        run2(words_checks);
    } else {
        return 2;
    }
    return 0;
}
