/*
 * A C host that computes an MLP's forward and backward itself, in plain loops, and trains
 * it with FSDP through the C ABI (include/fsdp.h): fsdp shards, gathers and reduces, the
 * host computes. Ranks are threads of this program (pthreads, init method threads://NAME).
 *
 *   model: x (n, 7) -> Linear "0" (5x7 + 5) -> ReLU -> Linear "2" (3x5 + 3) -> y (n, 3)
 *   loss:  mean over the local rows and outputs of (y - t)^2; gradients averaged over ranks
 *   data:  a global batch of 8 rows per step, split by contiguous rows across the ranks
 *
 * Unit "2" gets its gradients written into fsdp's gradient views (from pre_backward);
 * unit "0" passes the host's own gradient arrays to post_backward. Both add.
 *
 * With --precision bf16 (MixedPrecision(param_dtype=reduce_dtype=bfloat16)) the parameter
 * views are bfloat16 and the host computes as a bfloat16 module does (PyTorch FSDP's
 * param_dtype): every tensor is bfloat16, each layer computes in float32 and rounds its
 * output once (the linear layers' outputs with their bias, the loss gradient, the input
 * gradient); products accumulate in float32. Unit "0" then hands its gradients to
 * post_backward as bfloat16 arrays.
 *
 * usage: mlp [--strategy full-shard|shard-grad-op|no-shard] [--optim sgd|adamw]
 *            [--worlds 1,2,4] [--steps 5] [--accum K] [--clip X] [--precision f32|bf16]
 * (defaults shown; steps 0 to 64, K 1 to 8, worlds 1 to 8 each). Anything else (an unknown
 * argument, a missing or bad value) is refused with the usage on stderr and exit status 2.
 * prints, per world size: "loss WORLD STEP VALUE" lines and "param WORLD NAME v0 v1 ..."
 * lines (%.9g: float32 values round-trip exactly).
 *
 * Build (at the workspace root, after `cargo build --release -p fsdp-cli -p fsdp-capi`;
 * docs/embedding.md, "Embedding", also links it statically):
 *   cc -std=c11 -O2 -pthread -Icrates/fsdp-capi/include crates/fsdp-capi/examples/mlp.c \
 *      -Ltarget/release -lfsdp_capi -Wl,-rpath,"$PWD/target/release" -lm -o target/c/mlp
 */
#include "fsdp.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 8
#define IN 7
#define HID 5
#define OUT 3
#define MAX_WORLD 8

#define CHECK(call)                                                                      \
    do {                                                                                 \
        fsdp_status s_ = (call);                                                         \
        if (s_ != FSDP_OK) {                                                             \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,          \
                    fsdp_status_name(s_), fsdp_last_error());                            \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

static int32_t strategy = FSDP_FULL_SHARD;
static int32_t optim = FSDP_OPTIM_SGD;
static int steps = 5, accum = 1;
static float clip = 0.0f;
static int32_t precision = FSDP_PRECISION_F32;

/* float32 -> the nearest bfloat16 (ties to even; no NaN here), its bits; and back. */
static uint16_t to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* dst = src rounded to bfloat16 under --precision bf16, else a copy: a GEMM operand. */
static void operand(float *dst, const float *src, int n) {
    for (int i = 0; i < n; i++)
        dst[i] = precision == FSDP_PRECISION_BF16 ? from_bf16(to_bf16(src[i])) : src[i];
}

/* Deterministic data in [-1, 1]: element i of stream `seed` (the Rust tests compute the
 * same values). */
static float data_value(uint32_t seed, uint32_t i) {
    uint32_t h = seed * 2654435761u ^ (i + 1u) * 2246822519u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    h *= 3266489917u;
    h ^= h >> 16;
    return (float)(h % 2001u) / 1000.0f - 1.0f;
}

/* y (n, o) = x (n, i) W^T + b */
static void linear(const float *w, const float *b, const float *x, float *y, int n, int o,
                   int in) {
    for (int r = 0; r < n; r++)
        for (int j = 0; j < o; j++) {
            float acc = b[j];
            for (int k = 0; k < in; k++) acc += x[r * in + k] * w[j * in + k];
            y[r * o + j] = acc;
        }
}

/* dw += dy^T x, db += sum dy, dx = dy W (dx may be NULL), reading dy rounded to bfloat16
 * under bf16 (the output gradient of a bfloat16 layer). */
static void linear_backward(const float *w, const float *x, const float *dy, float *dw,
                            float *db, float *dx, int n, int o, int in) {
    float dyo[ROWS * OUT > ROWS * HID ? ROWS * OUT : ROWS * HID];
    operand(dyo, dy, n * o);
    if (dx) memset(dx, 0, sizeof(float) * n * in);
    for (int r = 0; r < n; r++)
        for (int j = 0; j < o; j++) {
            float g = dyo[r * o + j];
            db[j] += g;
            for (int k = 0; k < in; k++) {
                dw[j * in + k] += g * x[r * in + k];
                if (dx) dx[r * in + k] += g * w[j * in + k];
            }
        }
}

static float *as_f32(const DLTensor *t) {
    if (t->dtype.code != kDLFloat || t->dtype.bits != 32 || t->device.device_type != kDLCPU) {
        fprintf(stderr, "expected a float32 host tensor\n");
        exit(1);
    }
    return (float *)((char *)t->data + t->byte_offset);
}

/* A parameter view's n values as float32: the view itself, or (bfloat16 views under
 * --precision bf16) widened into `scratch`. */
static const float *param(const DLTensor *t, float *scratch, int n) {
    if (precision == FSDP_PRECISION_BF16) {
        if (t->dtype.code != kDLBfloat || t->dtype.bits != 16 || t->device.device_type != kDLCPU) {
            fprintf(stderr, "expected a bfloat16 host tensor\n");
            exit(1);
        }
        const uint16_t *h = (const uint16_t *)((const char *)t->data + t->byte_offset);
        for (int i = 0; i < n; i++) scratch[i] = from_bf16(h[i]);
        return scratch;
    }
    return as_f32(t);
}

/* One micro-batch: rows [lo, hi) of step `step`; returns the sum of squared errors. */
static float micro_batch(fsdp_model_t model, fsdp_unit_t root, fsdp_unit_t u0, fsdp_unit_t u2,
                         int step, int lo, int hi, float scale) {
    int n = hi - lo;
    float x0[ROWS * IN], x[ROWS * IN], t[ROWS * OUT], h[ROWS * HID], a0[ROWS * HID];
    float a[ROWS * HID], y[ROWS * OUT], dy[ROWS * OUT], da[ROWS * HID];
    float w[HID * IN], b[HID]; /* widened bfloat16 parameters */
    for (int r = 0; r < n; r++) {
        for (int k = 0; k < IN; k++) x0[r * IN + k] = data_value(100 + step, (lo + r) * IN + k);
        for (int k = 0; k < OUT; k++) t[r * OUT + k] = data_value(200 + step, (lo + r) * OUT + k);
    }
    operand(x, x0, n * IN);
    DLTensor p[2], g[2];
    /* forward: the root encloses the units */
    CHECK(fsdp_unit_pre_forward(root, true, NULL, 0, NULL));
    CHECK(fsdp_unit_pre_forward(u0, true, p, 2, NULL));
    linear(param(&p[0], w, HID * IN), param(&p[1], b, HID), x, h, n, HID, IN);
    CHECK(fsdp_unit_post_forward(u0, true, NULL));
    for (int i = 0; i < n * HID; i++) a0[i] = h[i] > 0.0f ? h[i] : 0.0f;
    operand(a, a0, n * HID);
    CHECK(fsdp_unit_pre_forward(u2, true, p, 2, NULL));
    linear(param(&p[0], w, OUT * HID), param(&p[1], b, OUT), a, y, n, OUT, HID);
    operand(y, y, n * OUT); /* the bfloat16 output */
    CHECK(fsdp_unit_post_forward(u2, true, NULL));
    CHECK(fsdp_unit_post_forward(root, true, NULL));
    /* mse over the micro-batch's elements, scaled for accumulation */
    float sse = 0.0f;
    for (int i = 0; i < n * OUT; i++) {
        float d = y[i] - t[i];
        sse += d * d;
        dy[i] = 2.0f * d / (float)(n * OUT) * scale;
    }
    /* backward, in reverse */
    CHECK(fsdp_unit_pre_backward(root, NULL, NULL, 0, NULL));
    CHECK(fsdp_unit_pre_backward(u2, p, g, 2, NULL));
    /* into fsdp's gradient views (float32 under every precision) */
    linear_backward(param(&p[0], w, OUT * HID), a, dy, as_f32(&g[0]), as_f32(&g[1]), da, n, OUT,
                    HID);
    CHECK(fsdp_unit_post_backward(u2, NULL, 0, true, NULL));
    operand(da, da, n * HID); /* the bfloat16 input gradient */
    for (int i = 0; i < n * HID; i++) da[i] = h[i] > 0.0f ? da[i] : 0.0f;
    CHECK(fsdp_unit_pre_backward(u0, p, NULL, 2, NULL));
    /* into the host's own arrays, handed to post_backward (as bfloat16 under bf16) */
    float dw[HID * IN] = {0}, db[HID] = {0};
    linear_backward(param(&p[0], w, HID * IN), x, da, dw, db, NULL, n, HID, IN);
    int64_t sw[2] = {HID, IN}, sb[1] = {HID};
    DLTensor mine[2] = {
        {dw, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, sw, NULL, 0},
        {db, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, sb, NULL, 0},
    };
    uint16_t dw16[HID * IN], db16[HID];
    if (precision == FSDP_PRECISION_BF16) {
        for (int i = 0; i < HID * IN; i++) dw16[i] = to_bf16(dw[i]);
        for (int i = 0; i < HID; i++) db16[i] = to_bf16(db[i]);
        DLDataType bf16 = {kDLBfloat, 16, 1};
        mine[0].data = dw16;
        mine[0].dtype = bf16;
        mine[1].data = db16;
        mine[1].dtype = bf16;
    }
    CHECK(fsdp_unit_post_backward(u0, mine, 2, true, NULL));
    CHECK(fsdp_unit_post_backward(root, NULL, 0, true, NULL));
    CHECK(fsdp_model_finish_backward(model, NULL));
    return sse;
}

/* Rank 0's full state dict, collected by the callback. */
typedef struct {
    int count;
    char names[4][32];
    float values[4][HID * IN];
    int numel[4];
} Params;

static int32_t collect(void *ctx, const char *name, const DLTensor *t) {
    Params *ps = (Params *)ctx;
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    if (ps->count >= 4 || n > HID * IN) return 1;
    snprintf(ps->names[ps->count], 32, "%s", name);
    memcpy(ps->values[ps->count], as_f32(t), sizeof(float) * (size_t)n);
    ps->numel[ps->count++] = (int)n;
    return 0;
}

typedef struct {
    int rank, world;
    float losses[64];
    Params params;
} Rank;

static void *rank_main(void *arg) {
    Rank *me = (Rank *)arg;
    char method[64];
    snprintf(method, sizeof method, "threads://mlp-%d-%d-%d-%d", (int)strategy, (int)optim,
             (int)precision, me->world);
    fsdp_init_options io;
    CHECK(fsdp_init_options_default(&io));
    io.init_method = method;
    io.rank = me->rank;
    io.world_size = me->world;
    fsdp_group_t world;
    CHECK(fsdp_init_process_group(&io, &world));

    /* Declare the units by their parameters: the values fsdp::nn::Linear draws from
     * InitKey::new(11).child(unit), computed shard by shard. */
    fsdp_spec_t spec;
    CHECK(fsdp_spec_new(&spec));
    const char *units[2] = {"0", "2"};
    int fan[2][2] = {{HID, IN}, {OUT, HID}};
    for (int u = 0; u < 2; u++) {
        int64_t w[2] = {fan[u][0], fan[u][1]}, b[1] = {fan[u][0]};
        float bound = 1.0f / sqrtf((float)fan[u][1]);
        CHECK(fsdp_spec_add_unit(spec, units[u]));
        CHECK(fsdp_spec_add_param_init(spec, units[u], "weight", 2, w, FSDP_INIT_UNIFORM, 11,
                                       bound, true));
        CHECK(fsdp_spec_add_param_init(spec, units[u], "bias", 1, b, FSDP_INIT_UNIFORM, 11,
                                       bound, true));
    }
    fsdp_config cfg;
    CHECK(fsdp_config_default(&cfg));
    cfg.sharding_strategy = strategy;
    cfg.mixed_precision = precision;
    fsdp_model_t model;
    CHECK(fsdp_model_new(world, spec, &cfg, &model));
    CHECK(fsdp_spec_free(spec));
    fsdp_unit_t root, u0, u2;
    CHECK(fsdp_model_unit_at(model, 0, &root));
    CHECK(fsdp_model_unit(model, "0", &u0));
    CHECK(fsdp_model_unit(model, "2", &u2));

    fsdp_optimizer_config oc;
    CHECK(fsdp_optimizer_config_default(optim, &oc));
    if (optim == FSDP_OPTIM_SGD) {
        oc.lr = 0.1f;
        oc.momentum = 0.9f;
    } else {
        oc.lr = 0.01f;
    }
    fsdp_optimizer_t opt;
    CHECK(fsdp_optimizer_new(model, &oc, &opt));

    int lo = me->rank * ROWS / me->world, hi = (me->rank + 1) * ROWS / me->world;
    for (int s = 0; s < steps; s++) {
        float sse = 0.0f;
        int n = hi - lo;
        for (int k = 0; k < accum; k++) {
            /* no_sync for every micro-batch but the last: gradients accumulate locally */
            CHECK(fsdp_model_set_no_sync(model, k + 1 < accum));
            sse += micro_batch(model, root, u0, u2, s, lo + k * n / accum,
                               lo + (k + 1) * n / accum, 1.0f / (float)accum);
        }
        if (clip > 0.0f) CHECK(fsdp_model_clip_grad_norm(model, clip, 2.0f, NULL, NULL));
        CHECK(fsdp_optimizer_step(opt, NULL));
        CHECK(fsdp_model_zero_grad(model));
        /* the global mean loss: a collective on the world group */
        int64_t one = 1;
        DLTensor l = {&sse, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &one, NULL, 0};
        CHECK(fsdp_all_reduce(world, &l, FSDP_REDUCE_SUM, NULL));
        me->losses[s] = sse / (float)(ROWS * OUT);
    }
    CHECK(fsdp_model_full_state_dict(model, true, collect, &me->params, NULL));
    CHECK(fsdp_optimizer_free(opt));
    CHECK(fsdp_model_free(model));
    CHECK(fsdp_destroy_process_group(world));
    return NULL;
}

static const char USAGE[] =
    "usage: mlp [--strategy full-shard|shard-grad-op|no-shard] [--optim sgd|adamw]\n"
    "           [--worlds 1,2,4] [--steps 5] [--accum K] [--clip X] [--precision f32|bf16]\n";

/* Refuses the command line: what is wrong, then the usage line, on stderr; exit 2. */
static int usage_error(const char *what, const char *arg) {
    fprintf(stderr, "mlp: %s%s%s\n%s", what, arg ? ": " : "", arg ? arg : "", USAGE);
    return 2;
}

/* *out = v parsed as a whole decimal integer in [lo, hi]; 0 when it is not one. */
static int parse_int(const char *v, long lo, long hi, int *out) {
    char *end;
    long n = strtol(v, &end, 10);
    if (end == v || *end || n < lo || n > hi) return 0;
    *out = (int)n;
    return 1;
}

int main(int argc, char **argv) {
    int worlds[8] = {1, 2, 4}, nworlds = 3;
    for (int i = 1; i < argc; i += 2) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(k, "--help") || !strcmp(k, "-h")) {
            fputs(USAGE, stdout);
            return 0;
        }
        int known = !strcmp(k, "--strategy") || !strcmp(k, "--optim") ||
                    !strcmp(k, "--steps") || !strcmp(k, "--accum") || !strcmp(k, "--clip") ||
                    !strcmp(k, "--precision") || !strcmp(k, "--worlds");
        if (!known) return usage_error("unknown argument", k);
        if (!v) return usage_error("missing value after", k);
        int bad = 0;
        if (!strcmp(k, "--strategy")) {
            if (!strcmp(v, "full-shard")) strategy = FSDP_FULL_SHARD;
            else if (!strcmp(v, "shard-grad-op")) strategy = FSDP_SHARD_GRAD_OP;
            else if (!strcmp(v, "no-shard")) strategy = FSDP_NO_SHARD;
            else bad = 1;
        } else if (!strcmp(k, "--optim")) {
            if (!strcmp(v, "sgd")) optim = FSDP_OPTIM_SGD;
            else if (!strcmp(v, "adamw")) optim = FSDP_OPTIM_ADAMW;
            else bad = 1;
        } else if (!strcmp(k, "--steps")) {
            bad = !parse_int(v, 0, 64, &steps);
        } else if (!strcmp(k, "--accum")) {
            bad = !parse_int(v, 1, ROWS, &accum);
        } else if (!strcmp(k, "--clip")) {
            char *end;
            clip = strtof(v, &end);
            bad = end == v || *end || !(clip >= 0.0f);
        } else if (!strcmp(k, "--precision")) {
            if (!strcmp(v, "f32")) precision = FSDP_PRECISION_F32;
            else if (!strcmp(v, "bf16")) precision = FSDP_PRECISION_BF16;
            else bad = 1;
        } else { /* --worlds: 1 to 8 world sizes, each 1 to MAX_WORLD, comma-separated */
            char list[64];
            bad = strlen(v) >= sizeof list;
            if (!bad) strcpy(list, v);
            nworlds = 0;
            for (char *s = bad ? NULL : strtok(list, ","); s && !bad; s = strtok(NULL, ","))
                bad = nworlds == 8 || !parse_int(s, 1, MAX_WORLD, &worlds[nworlds++]);
            bad = bad || nworlds == 0;
        }
        if (bad) {
            fprintf(stderr, "mlp: bad value for %s: %s\n%s", k, v, USAGE);
            return 2;
        }
    }
    if (fsdp_abi_version() != FSDP_ABI_VERSION) {
        fprintf(stderr, "libfsdp_capi ABI %u, header %u\n", fsdp_abi_version(), FSDP_ABI_VERSION);
        return 1;
    }
    for (int w = 0; w < nworlds; w++) {
        int world = worlds[w];
        Rank ranks[MAX_WORLD];
        pthread_t threads[MAX_WORLD];
        memset(ranks, 0, sizeof ranks);
        for (int r = 0; r < world; r++) {
            ranks[r].rank = r;
            ranks[r].world = world;
            pthread_create(&threads[r], NULL, rank_main, &ranks[r]);
        }
        for (int r = 0; r < world; r++) pthread_join(threads[r], NULL);
        for (int s = 0; s < steps; s++) printf("loss %d %d %.9g\n", world, s, ranks[0].losses[s]);
        const Params *ps = &ranks[0].params;
        for (int i = 0; i < ps->count; i++) {
            printf("param %d %s", world, ps->names[i]);
            for (int k = 0; k < ps->numel[i]; k++) printf(" %.9g", ps->values[i][k]);
            printf("\n");
        }
    }
    return 0;
}
