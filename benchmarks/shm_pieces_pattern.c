/* The memory pattern of hetccl's large shm all_reduce (hccl_fast_all_reduce_pieces), without hetccl: two
 * threads on cores 0 and 1, each with its own buffer and two slots, synchronised by spinning on a counter.
 * It shows what this machine's memory allows for one pattern and piece size, with nothing of hetccl's around
 * it (no Python, no segment header, no sleepers), so a gap to `hetccl bench` is hetccl's own cost.
 *
 *   gcc -O3 -march=native -o /tmp/shm_pieces_pattern benchmarks/shm_pieces_pattern.c -lpthread
 *   /tmp/shm_pieces_pattern MIB PIECE_KIB PATTERN     # e.g. 64 1024 1
 *
 * PATTERN 0: each rank copies its whole piece into its slot, then reduces both slots into its buffer (the
 * pieces of 2026-12-02, 06e076b). PATTERN 1: reduce-scatter and all-gather per piece (c24705c): each rank
 * copies the half its peer owns into its slot, reduces its own half into its buffer and its other slot, and
 * copies the peer's reduced half. Prints the milliseconds of 10 float32 sum all_reduces, after 2 warm-ups. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t total, piece;
static int pattern;
static float *buf[2];
static float *slot[2][2];
static uint64_t posted[2][8]; /* a cache line each */
static pthread_barrier_t bar;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void post_and_wait(int me, uint64_t k)
{
    __atomic_store_n(&posted[me][0], k + 1, __ATOMIC_RELEASE);
    while (__atomic_load_n(&posted[1 - me][0], __ATOMIC_ACQUIRE) < k + 1)
        __builtin_ia32_pause();
}

static void sum3(float *restrict d, const float *restrict a, const float *restrict b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        d[i] = a[i] + b[i];
}

static void sum_dup(float *restrict d, float *restrict d2, const float *restrict b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        d2[i] = d[i] = d[i] + b[i];
}

static void *rank_main(void *arg)
{
    int me = (int)(intptr_t)arg;
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    CPU_SET(me, &cpus);
    sched_setaffinity(0, sizeof cpus, &cpus);
    size_t count = total / 4, per = piece / 4;
    uint64_t k = 0;
    for (int it = 0; it < 12; it++) {
        pthread_barrier_wait(&bar);
        double t0 = now();
        for (size_t first = 0; first < count; first += per) {
            size_t m = count - first < per ? count - first : per, h = m / 2;
            float *p = buf[me] + first;
            if (pattern == 0) {
                memcpy(slot[me][k & 1], p, m * 4);
                post_and_wait(me, k);
                sum3(p, slot[0][k & 1], slot[1][k & 1], m);
                k++;
                continue;
            }
            size_t lo = me ? h : 0, hi = me ? m : h, plo = me ? 0 : h, phi = me ? h : m;
            memcpy(slot[me][k & 1] + plo, p + plo, (phi - plo) * 4);
            post_and_wait(me, k);
            sum_dup(p + lo, slot[me][(k + 1) & 1] + lo, slot[1 - me][k & 1] + lo, hi - lo);
            post_and_wait(me, ++k);
            memcpy(p + plo, slot[1 - me][k & 1] + plo, (phi - plo) * 4);
            k++;
        }
        pthread_barrier_wait(&bar);
        if (me == 0 && it >= 2)
            printf("%.2f ", (now() - t0) * 1e3);
    }
    if (me == 0)
        printf("ms\n");
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s MIB PIECE_KIB PATTERN(0|1)\n", argv[0]);
        return 2;
    }
    total = (size_t)atol(argv[1]) << 20;
    piece = (size_t)atol(argv[2]) << 10;
    pattern = atoi(argv[3]);
    for (int r = 0; r < 2; r++) {
        buf[r] = aligned_alloc(4096, total);
        memset(buf[r], 0, total);
        for (int j = 0; j < 2; j++) {
            slot[r][j] = aligned_alloc(4096, piece);
            memset(slot[r][j], 0, piece);
        }
    }
    pthread_barrier_init(&bar, NULL, 2);
    pthread_t t[2];
    for (int r = 0; r < 2; r++)
        pthread_create(&t[r], NULL, rank_main, (void *)(intptr_t)r);
    for (int r = 0; r < 2; r++)
        pthread_join(t[r], NULL);
    return 0;
}
