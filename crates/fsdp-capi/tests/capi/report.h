/*
 * What the C check programs of tests/capi/ share: MUST (exit on an unexpected failure),
 * the report lines tests/capi.rs's `assert_report` reads ("CASE <name> <status>
 * <message>" for a call expected to fail, "CHECK <name> ok|FAIL <detail>" for a value
 * checked; rank 0's only), joining a `threads://` world, and running two thread ranks.
 */
#ifndef FSDP_TESTS_CAPI_REPORT_H
#define FSDP_TESTS_CAPI_REPORT_H

#include "fsdp.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define MUST(call)                                                                       \
    do {                                                                                 \
        fsdp_status s_ = (call);                                                         \
        if (s_ != FSDP_OK) {                                                             \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,          \
                    fsdp_status_name(s_), fsdp_last_error());                            \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

static pthread_mutex_t print_lock = PTHREAD_MUTEX_INITIALIZER;

/* Prints one expected failure (rank 0's): its status and the thread's message. */
static void report(int rank, const char *name, fsdp_status s) {
    if (rank != 0) return;
    pthread_mutex_lock(&print_lock);
    printf("CASE %s %s ", name, fsdp_status_name(s));
    for (const char *c = s == FSDP_OK ? "" : fsdp_last_error(); *c; c++)
        putchar(*c == '\n' ? ' ' : *c);
    printf("\n");
    fflush(stdout);
    pthread_mutex_unlock(&print_lock);
}

/* Prints one checked value (rank 0's). */
static void check(int rank, const char *name, int ok, const char *detail) {
    if (rank != 0) return;
    pthread_mutex_lock(&print_lock);
    printf("CHECK %s %s %s\n", name, ok ? "ok" : "FAIL", detail);
    fflush(stdout);
    pthread_mutex_unlock(&print_lock);
}

/* Joins the calling thread to the world `name` (a threads:// init method) as `rank`. */
static fsdp_group_t join(const char *name, int rank, int world, uint32_t timeout_ms) {
    fsdp_init_options o;
    MUST(fsdp_init_options_default(&o));
    o.init_method = name;
    o.rank = rank;
    o.world_size = world;
    o.timeout_ms = timeout_ms;
    fsdp_group_t g;
    MUST(fsdp_init_process_group(&o, &g));
    return g;
}

/* Runs `f` on two threads, ranks 0 and 1 (`*(int *)arg`), and waits for both. */
static void run2(void *(*f)(void *)) {
    pthread_t t[2];
    int ranks[2] = {0, 1};
    for (int r = 0; r < 2; r++) pthread_create(&t[r], NULL, f, &ranks[r]);
    for (int r = 0; r < 2; r++) pthread_join(t[r], NULL);
}

#endif /* FSDP_TESTS_CAPI_REPORT_H */
