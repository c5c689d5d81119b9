/*
 * Bad input and the less common calls through the C ABI, from C: every misuse returns a
 * status naming the problem, and nothing is corrupted. Ranks are threads (world 2).
 * Prints "CASE <name> <status> <message>" for each call expected to fail and
 * "CHECK <name> ok|FAIL <detail>" for each value checked; tests/capi/bad_input.rs asserts
 * them.
 *
 * usage: abi_checks CHECKPOINT_DIR
 */
#include "report.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *ckpt_dir;

static DLTensor f32_tensor(float *data, int32_t ndim, int64_t *shape) {
    DLTensor t = {data, {kDLCPU, 0}, ndim, {kDLFloat, 32, 1}, shape, NULL, 0};
    return t;
}

/* Units "0" (weight 3x2, bias 3) and "1" (weight 1x3), values from `base`. */
static fsdp_status build(fsdp_group_t g, float base, int32_t strategy, int32_t precision,
                         fsdp_model_t *out) {
    fsdp_spec_t spec;
    MUST(fsdp_spec_new(&spec));
    float w0[6], b0[3], w1[3];
    for (int i = 0; i < 6; i++) w0[i] = base + 0.1f * (float)i;
    for (int i = 0; i < 3; i++) b0[i] = base - 0.2f * (float)i;
    for (int i = 0; i < 3; i++) w1[i] = base * 0.5f + 0.3f * (float)i;
    int64_t s_w0[2] = {3, 2}, s_b0[1] = {3}, s_w1[2] = {1, 3};
    MUST(fsdp_spec_add_unit(spec, "0"));
    MUST(fsdp_spec_add_unit(spec, "1"));
    MUST(fsdp_spec_add_param(spec, "0", "weight", 2, s_w0, w0, true));
    MUST(fsdp_spec_add_param(spec, "0", "bias", 1, s_b0, b0, true));
    MUST(fsdp_spec_add_param(spec, "1", "weight", 2, s_w1, w1, true));
    fsdp_config c;
    MUST(fsdp_config_default(&c));
    c.sharding_strategy = strategy;
    c.mixed_precision = precision;
    fsdp_status s = fsdp_model_new(g, spec, &c, out);
    MUST(fsdp_spec_free(spec));
    return s;
}

typedef struct {
    float v[16];
    int n;
} Flat;

static int32_t flatten(void *ctx, const char *name, const DLTensor *t) {
    (void)name;
    Flat *f = (Flat *)ctx;
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    memcpy(f->v + f->n, (const float *)t->data, sizeof(float) * (size_t)n);
    f->n += (int)n;
    return 0;
}

static int32_t stop(void *ctx, const char *name, const DLTensor *t) {
    (void)ctx, (void)name, (void)t;
    return 7;
}

/* One SGD step of a linear "model": y = W1 (W0 x + b0), loss sum(y); with `bad`, every kind
 * of bad gradient is offered to unit "1" first (and refused). */
static void step(int rank, fsdp_model_t m, fsdp_optimizer_t opt, int bad) {
    fsdp_unit_t root, u0, u1;
    MUST(fsdp_model_unit_at(m, 0, &root));
    MUST(fsdp_model_unit(m, "0", &u0));
    MUST(fsdp_model_unit(m, "1", &u1));
    float x[2] = {1.0f + (float)rank, -0.5f};
    DLTensor p[2], g[2];
    MUST(fsdp_unit_pre_forward(root, true, NULL, 0, NULL));
    MUST(fsdp_unit_pre_forward(u0, true, p, 2, NULL));
    float h[3];
    const float *w0 = p[0].data, *b0 = p[1].data;
    for (int j = 0; j < 3; j++) h[j] = b0[j] + w0[j * 2] * x[0] + w0[j * 2 + 1] * x[1];
    MUST(fsdp_unit_post_forward(u0, true, NULL));
    MUST(fsdp_unit_pre_forward(u1, true, p, 1, NULL));
    float w1[3];
    memcpy(w1, p[0].data, sizeof w1);
    MUST(fsdp_unit_post_forward(u1, true, NULL));
    MUST(fsdp_unit_post_forward(root, true, NULL));
    MUST(fsdp_unit_pre_backward(root, NULL, NULL, 0, NULL));
    MUST(fsdp_unit_pre_backward(u1, p, g, 1, NULL));
    float dw1[3] = {h[0], h[1], h[2]};
    int64_t s_ok[2] = {1, 3}, s_bad[2] = {3, 1};
    DLTensor good = f32_tensor(dw1, 2, s_ok);
    if (bad) {
        DLTensor t = f32_tensor(dw1, 2, s_bad);
        report(rank, "grad_wrong_shape", fsdp_unit_post_backward(u1, &t, 1, true, NULL));
        t = good;
        t.dtype.bits = 16;
        report(rank, "grad_wrong_dtype", fsdp_unit_post_backward(u1, &t, 1, true, NULL));
        t = good;
        t.dtype.code = kDLInt;
        report(rank, "grad_int_dtype", fsdp_unit_post_backward(u1, &t, 1, true, NULL));
        DLTensor two[2] = {good, good};
        report(rank, "grad_wrong_count", fsdp_unit_post_backward(u1, two, 2, true, NULL));
        report(rank, "grad_is_fsdp_view", fsdp_unit_post_backward(u1, g, 1, true, NULL));
        t = good;
        t.device.device_type = kDLCUDA;
        report(rank, "grad_on_cuda", fsdp_unit_post_backward(u1, &t, 1, true, NULL));
        t.device.device_id = -1;
        report(rank, "grad_cuda_negative_id", fsdp_unit_post_backward(u1, &t, 1, true, NULL));
        t = good;
        t.device.device_type = kDLCUDAManaged;
        report(rank, "grad_managed", fsdp_unit_post_backward(u1, &t, 1, true, NULL));
        t = good;
        t.data = NULL;
        report(rank, "grad_null_data", fsdp_unit_post_backward(u1, &t, 1, true, NULL));
        t = good;
        t.ndim = -1;
        report(rank, "grad_negative_ndim", fsdp_unit_post_backward(u1, &t, 1, true, NULL));
        t = good;
        t.byte_offset = 2;
        report(rank, "grad_misaligned", fsdp_unit_post_backward(u1, &t, 1, true, NULL));
        report(rank, "pre_backward_twice", fsdp_unit_pre_backward(u1, NULL, NULL, 0, NULL));
    }
    MUST(fsdp_unit_post_backward(u1, &good, 1, true, NULL));
    MUST(fsdp_unit_pre_backward(u0, p, g, 2, NULL));
    float *dw0 = g[0].data, *db0 = g[1].data;
    for (int j = 0; j < 3; j++) {
        db0[j] += w1[j];
        dw0[j * 2] += w1[j] * x[0];
        dw0[j * 2 + 1] += w1[j] * x[1];
    }
    MUST(fsdp_unit_post_backward(u0, NULL, 0, true, NULL));
    MUST(fsdp_unit_post_backward(root, NULL, 0, true, NULL));
    MUST(fsdp_model_finish_backward(m, NULL));
    MUST(fsdp_optimizer_step(opt, NULL));
    MUST(fsdp_model_zero_grad(m));
}

static fsdp_optimizer_t sgd(fsdp_model_t m) {
    fsdp_optimizer_config oc;
    MUST(fsdp_optimizer_config_default(FSDP_OPTIM_SGD, &oc));
    oc.lr = 0.05f;
    fsdp_optimizer_t o;
    MUST(fsdp_optimizer_new(m, &oc, &o));
    return o;
}

static void *main_checks(void *arg) {
    int rank = *(int *)arg;
    fsdp_group_t world = join("threads://abi-checks", rank, 2, 0);
    fsdp_model_t m, clean;
    size_t n;
    /* handles */
    fsdp_model_t null_model = {0};
    report(rank, "null_model", fsdp_model_num_units(null_model, &n));
    MUST(build(world, 1.0f, FSDP_FULL_SHARD, FSDP_PRECISION_F32, &m));
    fsdp_model_t group_as_model = {world.id};
    report(rank, "group_as_model", fsdp_model_num_units(group_as_model, &n));
    fsdp_model_t forged = {0xdeadbeef00000999ull};
    report(rank, "forged_handle", fsdp_model_num_units(forged, &n));
    fsdp_spec_t s1, s2;
    MUST(fsdp_spec_new(&s1));
    MUST(fsdp_spec_free(s1));
    MUST(fsdp_spec_new(&s2)); /* reuses s1's slot with a new generation */
    report(rank, "freed_spec", fsdp_spec_add_unit(s1, "x"));
    report(rank, "spec_param_undeclared_unit",
           fsdp_spec_add_param(s2, "nope", "w", 0, NULL, NULL, true));
    MUST(fsdp_spec_free(s2));
    report(rank, "null_out", fsdp_model_num_units(m, NULL));
    fsdp_unit_t u;
    report(rank, "unknown_unit", fsdp_model_unit(m, "nope", &u));
    report(rank, "unit_index_out_of_range", fsdp_model_unit_at(m, 3, &u));
    fsdp_config c;
    MUST(fsdp_config_default(&c));
    c.sharding_strategy = 42;
    fsdp_spec_t empty;
    MUST(fsdp_spec_new(&empty));
    fsdp_model_t not_built = {0};
    report(rank, "bad_strategy", fsdp_model_new(world, empty, &c, &not_built));
    check(rank, "failed_model_is_null", not_built.id == 0, "");
    MUST(fsdp_config_default(&c));
    check(rank, "config_default_on_cpu", c.device.device_type == kDLCPU && c.device.device_id == 0,
          "");
    c.device.device_type = (DLDeviceType)7;
    report(rank, "config_bad_device_type", fsdp_model_new(world, empty, &c, &not_built));
    c.device.device_type = kDLCPU;
    c.device.device_id = 3;
    report(rank, "config_cpu_device_id", fsdp_model_new(world, empty, &c, &not_built));
    MUST(fsdp_spec_free(empty));
    fsdp_optimizer_config oc;
    report(rank, "bad_optimizer_kind", fsdp_optimizer_config_default(9, &oc));

    /* out of order */
    fsdp_unit_t root, u1;
    MUST(fsdp_model_unit_at(m, 0, &root));
    MUST(fsdp_model_unit(m, "1", &u1));
    report(rank, "stream_not_null", fsdp_unit_pre_forward(root, true, NULL, 0, (void *)0x1));
    report(rank, "post_forward_first", fsdp_unit_post_forward(u1, true, NULL));
    report(rank, "post_backward_first", fsdp_unit_post_backward(u1, NULL, 0, true, NULL));
    float dw[3] = {0};
    int64_t s13[2] = {1, 3};
    DLTensor gd = f32_tensor(dw, 2, s13);
    report(rank, "post_backward_first_with_grads",
           fsdp_unit_post_backward(u1, &gd, 1, true, NULL));
    MUST(fsdp_unit_pre_forward(root, true, NULL, 0, NULL));
    report(rank, "pre_forward_twice", fsdp_unit_pre_forward(root, true, NULL, 0, NULL));
    DLTensor few[1];
    fsdp_unit_t u0;
    MUST(fsdp_model_unit(m, "0", &u0));
    report(rank, "params_array_too_short", fsdp_unit_pre_forward(u0, true, few, 1, NULL));
    MUST(fsdp_unit_post_forward(root, false, NULL));

    /* bad gradients change nothing: the same step with and without them */
    fsdp_optimizer_t o = sgd(m);
    step(rank, m, o, 1);
    MUST(build(world, 1.0f, FSDP_FULL_SHARD, FSDP_PRECISION_F32, &clean));
    fsdp_optimizer_t oc2 = sgd(clean);
    step(rank, clean, oc2, 0);
    Flat a = {{0}, 0}, b = {{0}, 0};
    MUST(fsdp_model_full_state_dict(m, false, flatten, &a, NULL));
    MUST(fsdp_model_full_state_dict(clean, false, flatten, &b, NULL));
    check(rank, "bad_grads_changed_nothing",
          a.n == 12 && memcmp(a.v, b.v, sizeof(float) * 12) == 0 && a.v[0] != 1.0f, "");
    report(rank, "callback_stops", fsdp_model_full_state_dict(m, false, stop, NULL, NULL));
    report(rank, "callback_null", fsdp_model_full_state_dict(m, false, NULL, NULL, NULL));

    /* a checkpoint round trip into a model of other values, and a missing checkpoint */
    MUST(fsdp_checkpoint_save(m, o, ckpt_dir, FSDP_CHECKPOINT_SHARDED, NULL));
    fsdp_model_t other;
    MUST(build(world, -3.0f, FSDP_SHARD_GRAD_OP, FSDP_PRECISION_F32, &other));
    fsdp_optimizer_t oo = sgd(other);
    MUST(fsdp_checkpoint_load(other, oo, ckpt_dir, NULL));
    Flat r = {{0}, 0};
    MUST(fsdp_model_full_state_dict(other, false, flatten, &r, NULL));
    check(rank, "checkpoint_round_trip", r.n == 12 && !memcmp(r.v, a.v, sizeof(float) * 12), "");
    report(rank, "checkpoint_missing",
           fsdp_checkpoint_load(other, oo, "/nonexistent/fsdp-checkpoint", NULL));
    report(rank, "optimizer_of_another_model",
           fsdp_checkpoint_save(m, oo, ckpt_dir, FSDP_CHECKPOINT_FULL, NULL));
    MUST(fsdp_optimizer_free(oo));
    MUST(fsdp_model_free(other));

    /* mixed precision: parameter views are bfloat16; gradients float32 or bfloat16 */
    fsdp_model_t mp;
    MUST(build(world, 1.0f, FSDP_FULL_SHARD, FSDP_PRECISION_BF16, &mp));
    fsdp_unit_t mroot, mu0, mu1;
    MUST(fsdp_model_unit_at(mp, 0, &mroot));
    MUST(fsdp_model_unit(mp, "0", &mu0));
    MUST(fsdp_model_unit(mp, "1", &mu1));
    DLTensor pv[2];
    MUST(fsdp_unit_pre_forward(mroot, true, NULL, 0, NULL));
    MUST(fsdp_unit_pre_forward(mu0, true, pv, 2, NULL));
    uint16_t w0 = ((const uint16_t *)pv[0].data)[1]; /* 1.1f rounded to bf16: 0x3f8d */
    char detail[96];
    snprintf(detail, sizeof detail, "code %d bits %d value %#x; bias code %d bits %d",
             pv[0].dtype.code, pv[0].dtype.bits, w0, pv[1].dtype.code, pv[1].dtype.bits);
    check(rank, "bf16_views",
          pv[0].dtype.code == kDLBfloat && pv[0].dtype.bits == 16 && w0 == 0x3f8d &&
              pv[1].dtype.code == kDLBfloat && pv[1].dtype.bits == 16 &&
              pv[0].device.device_type == kDLCPU,
          detail);
    MUST(fsdp_unit_post_forward(mu0, true, NULL));
    MUST(fsdp_unit_pre_forward(mu1, true, NULL, 0, NULL));
    MUST(fsdp_unit_post_forward(mu1, true, NULL));
    MUST(fsdp_unit_post_forward(mroot, true, NULL));
    MUST(fsdp_unit_pre_backward(mroot, NULL, NULL, 0, NULL));
    MUST(fsdp_unit_pre_backward(mu1, NULL, NULL, 0, NULL));
    MUST(fsdp_unit_post_backward(mu1, NULL, 0, true, NULL));
    DLTensor mg[2];
    MUST(fsdp_unit_pre_backward(mu0, NULL, mg, 2, NULL));
    check(rank, "grad_views_stay_f32", mg[0].dtype.code == kDLFloat && mg[0].dtype.bits == 32, "");
    /* d loss / d weight = 1 as bfloat16 (0x3f80), d loss / d bias = 1 as float32 */
    uint16_t gw[6];
    float gb[3] = {1, 1, 1};
    for (int i = 0; i < 6; i++) gw[i] = 0x3f80;
    int64_t s32[2] = {3, 2}, s3[1] = {3};
    DLTensor mine[2] = {
        {gw, {kDLCPU, 0}, 2, {kDLBfloat, 16, 1}, s32, NULL, 0},
        f32_tensor(gb, 1, s3),
    };
    DLTensor f16[2] = {mine[0], mine[1]};
    f16[0].dtype.code = kDLFloat;
    report(rank, "grad_f16_on_bf16_model", fsdp_unit_post_backward(mu0, f16, 2, true, NULL));
    MUST(fsdp_unit_post_backward(mu0, mine, 2, true, NULL));
    MUST(fsdp_unit_post_backward(mroot, NULL, 0, true, NULL));
    MUST(fsdp_model_finish_backward(mp, NULL));
    fsdp_optimizer_t mo = sgd(mp);
    MUST(fsdp_optimizer_step(mo, NULL));
    Flat q = {{0}, 0};
    MUST(fsdp_model_full_state_dict(mp, false, flatten, &q, NULL));
    /* float32 master weights: 1.1 - 0.05 * 1 and 1.0 - 0.05 * 1; unit "1" had no gradient */
    float want_w = 1.1f - 0.05f, want_b = 1.0f - 0.05f;
    snprintf(detail, sizeof detail, "w %.9g (want %.9g) b %.9g (want %.9g) w1 %.9g", q.v[1],
             want_w, q.v[6], want_b, q.v[9]);
    check(rank, "bf16_grads_step",
          q.n == 12 && fabsf(q.v[1] - want_w) < 1e-6f && fabsf(q.v[6] - want_b) < 1e-6f &&
              q.v[9] == 0.5f,
          detail);
    MUST(fsdp_optimizer_free(mo));
    MUST(fsdp_model_free(mp));
    /* float16: views are kDLFloat of 16 bits */
    MUST(build(world, 1.0f, FSDP_NO_SHARD, FSDP_PRECISION_F16, &mp));
    MUST(fsdp_model_unit_at(mp, 0, &mroot));
    MUST(fsdp_model_unit(mp, "0", &mu0));
    MUST(fsdp_unit_pre_forward(mroot, false, NULL, 0, NULL));
    MUST(fsdp_unit_pre_forward(mu0, false, pv, 2, NULL));
    w0 = ((const uint16_t *)pv[0].data)[1]; /* 1.1f rounded to float16: 0x3c66 */
    snprintf(detail, sizeof detail, "code %d bits %d value %#x", pv[0].dtype.code,
             pv[0].dtype.bits, w0);
    check(rank, "f16_views", pv[0].dtype.code == kDLFloat && pv[0].dtype.bits == 16 && w0 == 0x3c66,
          detail);
    MUST(fsdp_unit_post_forward(mu0, true, NULL));
    MUST(fsdp_unit_post_forward(mroot, true, NULL));
    MUST(fsdp_model_free(mp));

    /* collectives */
    float v[4] = {(float)rank + 1, 2, 3, 4}, out[8];
    int64_t s4[1] = {4}, s8[1] = {8}, sh2[1] = {2};
    DLTensor tv = f32_tensor(v, 1, s4), to = f32_tensor(out, 1, s8);
    MUST(fsdp_all_gather_into_tensor(world, &to, &tv, NULL));
    check(rank, "all_gather", out[0] == 1 && out[4] == 2 && out[7] == 4, "");
    DLTensor half = f32_tensor(out, 1, sh2);
    MUST(fsdp_reduce_scatter_tensor(world, &half, &tv, FSDP_REDUCE_SUM, NULL));
    check(rank, "reduce_scatter", out[0] == 3 && out[1] == 4, "");
    MUST(fsdp_all_reduce(world, &tv, FSDP_REDUCE_MAX, NULL));
    check(rank, "all_reduce_max", v[0] == 2, "");
    int32_t iv[2] = {rank * 10, 7};
    DLTensor ti = {iv, {kDLCPU, 0}, 1, {kDLInt, 32, 1}, sh2, NULL, 0};
    MUST(fsdp_broadcast(world, &ti, 1, NULL));
    check(rank, "broadcast_int32", iv[0] == 10 && iv[1] == 7, "");
    MUST(fsdp_barrier(world));
    report(rank, "all_gather_wrong_size", fsdp_all_gather_into_tensor(world, &tv, &tv, NULL));
    report(rank, "bad_reduce_op", fsdp_all_reduce(world, &tv, 99, NULL));
    report(rank, "broadcast_bad_src", fsdp_broadcast(world, &tv, 5, NULL));
    DLTensor on_gpu = tv;
    on_gpu.device.device_type = kDLCUDA;
    report(rank, "collective_mixed_devices",
           fsdp_all_gather_into_tensor(world, &to, &on_gpu, NULL));
    report(rank, "collective_host_with_stream", fsdp_all_reduce(world, &tv, FSDP_REDUCE_SUM, (void *)0x1));
    int32_t r0 = -1, sz = -1;
    MUST(fsdp_group_rank(world, &r0));
    MUST(fsdp_group_size(world, &sz));
    check(rank, "rank_and_size", r0 == rank && sz == 2, "");

    /* a unit used after its group was destroyed */
    int32_t both[2] = {0, 1};
    fsdp_group_t sub;
    MUST(fsdp_new_group(world, both, 2, &sub));
    fsdp_model_t on_sub;
    MUST(build(sub, 0.5f, FSDP_NO_SHARD, FSDP_PRECISION_F32, &on_sub));
    fsdp_unit_t su;
    MUST(fsdp_model_unit(on_sub, "1", &su));
    MUST(fsdp_destroy_process_group(sub));
    report(rank, "unit_after_group_destroyed", fsdp_unit_pre_forward(su, true, NULL, 0, NULL));
    report(rank, "collective_on_destroyed_group", fsdp_barrier(sub));
    MUST(fsdp_model_free(on_sub));

    /* freed handles */
    MUST(fsdp_model_free(m));
    report(rank, "freed_model", fsdp_model_num_units(m, &n));
    report(rank, "unit_of_freed_model", fsdp_unit_pre_forward(u1, true, NULL, 0, NULL));
    report(rank, "double_free", fsdp_model_free(m));
    report(rank, "optimizer_of_freed_model", fsdp_optimizer_step(o, NULL));
    MUST(fsdp_optimizer_free(o));
    MUST(fsdp_optimizer_free(oc2));
    MUST(fsdp_model_free(clean));
    MUST(fsdp_destroy_process_group(world));
    report(rank, "destroy_twice", fsdp_destroy_process_group(world));
    return NULL;
}

/* A rank that leaves: its peer's next collective fails naming it. */
static void *leaving(void *arg) {
    int rank = *(int *)arg;
    fsdp_group_t world = join("threads://abi-leave", rank, 2, 0);
    fsdp_model_t m;
    MUST(build(world, 1.0f, FSDP_FULL_SHARD, FSDP_PRECISION_F32, &m));
    if (rank == 1) {
        MUST(fsdp_model_free(m));
        MUST(fsdp_destroy_process_group(world));
        return NULL;
    }
    fsdp_unit_t u0;
    MUST(fsdp_model_unit(m, "0", &u0));
    fsdp_unit_t root;
    MUST(fsdp_model_unit_at(m, 0, &root));
    fsdp_status s = fsdp_unit_pre_forward(root, true, NULL, 0, NULL);
    if (s == FSDP_OK) s = fsdp_unit_pre_forward(u0, true, NULL, 0, NULL);
    report(rank, "peer_left", s);
    MUST(fsdp_model_free(m));
    MUST(fsdp_destroy_process_group(world));
    return NULL;
}

/* A rank that stops calling without leaving: its peer times out naming it. */
static pthread_mutex_t hang_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hang_cond = PTHREAD_COND_INITIALIZER;
static int hang_done = 0;

static void *hanging(void *arg) {
    int rank = *(int *)arg;
    fsdp_group_t world = join("threads://abi-hang", rank, 2, 1000);
    if (rank == 1) {
        pthread_mutex_lock(&hang_lock);
        while (!hang_done) pthread_cond_wait(&hang_cond, &hang_lock);
        pthread_mutex_unlock(&hang_lock);
    } else {
        report(rank, "peer_stopped_calling", fsdp_barrier(world));
        pthread_mutex_lock(&hang_lock);
        hang_done = 1;
        pthread_cond_broadcast(&hang_cond);
        pthread_mutex_unlock(&hang_lock);
    }
    MUST(fsdp_destroy_process_group(world));
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    ckpt_dir = argv[1];
    /* before any world: local errors */
    fsdp_init_options o;
    MUST(fsdp_init_options_default(&o));
    fsdp_group_t g;
    o.backend = "mpi";
    o.init_method = "threads://x";
    o.rank = 0;
    o.world_size = 1;
    report(0, "init_unsupported_backend", fsdp_init_process_group(&o, &g));
    o.backend = NULL;
    o.rank = 5;
    o.world_size = 2;
    report(0, "init_rank_out_of_range", fsdp_init_process_group(&o, &g));
    report(0, "init_null_out", fsdp_init_process_group(&o, NULL));
    check(0, "status_name", !strcmp(fsdp_status_name(FSDP_ERR_PEER_FAILED), "FSDP_ERR_PEER_FAILED"), "");
    check(0, "abi_version", fsdp_abi_version() == FSDP_ABI_VERSION && FSDP_ABI_VERSION == 2, "");
    run2(main_checks);
    run2(leaving);
    run2(hanging);
    return 0;
}
