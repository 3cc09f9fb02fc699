/* hetccl native kernels: element-wise reductions and shared-memory synchronisation.
 *
 * This file is also the cffi cdef (native/build.py), so it must stay cdef-parseable:
 * plain declarations, comments and `#define NAME <integer>` only (no include guards, no
 * includes, no other macros). hetccl_native.c includes <stddef.h>/<stdint.h> before it.
 */

/* dtype codes (mirrored by hetccl.dtypes.DType) */
#define HCCL_INT8 0
#define HCCL_UINT8 1
#define HCCL_INT32 2
#define HCCL_INT64 3
#define HCCL_FLOAT16 4
#define HCCL_BFLOAT16 5
#define HCCL_FLOAT32 6
#define HCCL_FLOAT64 7
#define HCCL_NUM_DTYPES 8

/* reduce op codes (avg is done by the caller as sum followed by hccl_div) */
#define HCCL_SUM 0
#define HCCL_PROD 1
#define HCCL_MIN 2
#define HCCL_MAX 3
#define HCCL_NUM_OPS 4

/* Semantics shared by the reduce functions:
 *  - integers: sum and prod wrap around (two's complement, like numpy); min/max are the usual ones.
 *  - float32/float64: IEEE arithmetic in the dtype itself.
 *  - float16/bfloat16: both operands are widened to float32, the op is done in float32 and the
 *    result is rounded once back (round-to-nearest-even; NaN stays a (quiet) NaN; overflow gives inf).
 *  - min/max on floats propagate NaN (numpy.minimum/numpy.maximum semantics): if either operand is
 *    NaN the result is NaN. When the operands compare equal (e.g. -0.0 and +0.0) the result is b.
 *  - count == 0 is a no-op (pointers are not touched and may be NULL).
 */

/* dst[i] = dst[i] OP src[i]. Returns 0, or -1 for an unknown dtype/op.
 * dst and src never overlap partially (they may be equal). */
int hccl_reduce(void *dst, const void *src, size_t count, int dtype, int op);
/* dst[i] = a[i] OP b[i]; dst may equal a or b. Returns 0, or -1 for an unknown dtype/op. */
int hccl_reduce3(void *dst, const void *a, const void *b, size_t count, int dtype, int op);
/* dst[i] = a[i] OP b[i] and dst2[i] = the same value (fused: write the result to two places, e.g. the
 * user's buffer and an outgoing shared-memory slot). dst2 may be NULL (then this is hccl_reduce3).
 * Returns 0, or -1 for an unknown dtype/op. */
int hccl_reduce3_dup(void *dst, void *dst2, const void *a, const void *b, size_t count, int dtype, int op);
/* In-place divide (for avg). Floats: x = x / divisor (float32 divides by (float)divisor, float64 by
 * (double)divisor, float16/bfloat16 are computed in float32 and rounded once). Integers: C truncating
 * division (toward zero) done in int64, then wrapped to the dtype (so INT_MIN / -1 wraps to INT_MIN).
 * Returns 0, or -1 for an unknown dtype or divisor == 0 (nothing is written then). */
int hccl_div(void *dst, size_t count, int dtype, int64_t divisor);
/* plain copy (memcpy; cffi releases the GIL around it). dst and src must not overlap. */
void hccl_copy(void *dst, const void *src, size_t nbytes);
/* element size in bytes of a dtype code, or 0 if unknown */
size_t hccl_dtype_size(int dtype);

/* Compressed wire formats for the bytes that cross between island leaders (hetccl/compress.py). A packed
 * buffer of `count` elements: bf16 / fp16, count 2-byte values (round to nearest even; overflow -> inf, as
 * hccl_reduce's conversions); fp8, e4m3 (OCP "fn": max 448, no infinity) with one float32 scale per group of
 * HCCL_FP8_GROUP values: the scales of every group first, then count one-byte codes. A scale is the power of
 * two that brings the group's largest finite magnitude to at most 448, so a value exact in e4m3 after
 * scaling comes back exact, and scaling makes no NaN or inf; an infinity or NaN in the data is sent as NaN
 * (e4m3 has no infinity). Sources and destinations: float16, bfloat16, float32 or float64. */
#define HCCL_WIRE_BF16 1
#define HCCL_WIRE_FP16 2
#define HCCL_WIRE_FP8 3
#define HCCL_FP8_GROUP 1024
/* bytes of `count` packed elements, or 0 for an unknown wire format */
size_t hccl_wire_size(size_t count, int wire);
/* pack count elements of src (dtype) into dst (hccl_wire_size bytes). Returns 0, or -1 for a dtype or wire
 * it does not take. */
int hccl_pack(void *dst, const void *src, size_t count, int dtype, int wire);
/* dst (count elements of dtype) = the packed values of src (op < 0), or dst OP them (op: a reduce op code,
 * with hccl_reduce's semantics). Returns 0, or -1 for a dtype, wire or op it does not take. */
int hccl_unpack(void *dst, const void *src, size_t count, int dtype, int wire, int op);
/* The owner's step of a compressed all_reduce, one pass: the reduction (op, in dtype, in order) of the nsrc
 * packed buffers srcs[0..nsrc-1] of count values is packed into `packed`, and dst (count elements of dtype)
 * receives what that packing carries, the bits every other rank unpacks. Returns 0, or -1 as hccl_unpack. */
int hccl_unpack_reduce_pack(void *dst, const void *const *srcs, int nsrc, size_t count, int dtype, int wire,
                            int op, void *packed);

/* Shared-memory synchronisation on 64-bit counters living in a MAP_SHARED mapping (8-byte aligned). */
uint64_t hccl_load_acquire(const uint64_t *addr);
void hccl_store_release(uint64_t *addr, uint64_t value);
/* atomic, seq_cst, returns the old value */
uint64_t hccl_fetch_add(uint64_t *addr, uint64_t delta);
/* Wait until *addr >= target (unsigned compare). Spins (x86 `pause`, a compiler barrier elsewhere) for up
 * to spin_ns nanoseconds, reading the monotonic clock every ~64 iterations; then, for up to yield_ns
 * more, alternates checking and sched_yield(). Returns 1 if the condition held, 0 if the time ran out.
 * Never sleeps. */
int hccl_wait_ge(const uint64_t *addr, uint64_t target, uint64_t spin_ns, uint64_t yield_ns);
/* Same, but waits until *addr != value. */
int hccl_wait_ne(const uint64_t *addr, uint64_t value, uint64_t spin_ns, uint64_t yield_ns);
/* Wait until any *addrs[i] != vals[i] (spin, then sched_yield, with the same timing rules as
 * hccl_wait_ge); index of a changed one (the lowest), or -1 on time-out. n <= 0 returns -1 at once. */
int hccl_wait_any_change(uint64_t **addrs, const uint64_t *vals, int n, uint64_t spin_ns, uint64_t yield_ns);
/* The small-message fast path (hetccl/fastpath.py): every rank of a group on one host owns a segment of
 * hccl_fast_seg_size(max_bytes) bytes, mapped by all; `segs[r]` is group rank r's. Fast operation number k
 * (counted per group, the same on every rank) writes its fingerprint (4 words: group sequence number,
 * op | dtype << 8 | redop << 16, count, root) and data into slot k & 1 of its own segment and publishes
 * k + 1 (release). Ranks run their fast operations one after the other, so double buffering is enough:
 * a rank writes slot k & 1 again (operation k + 2) only after every peer published k + 2, i.e. finished
 * reading operation k. A collective that takes another path announces its sequence number in a ring of
 * 64 entries (hccl_fast_announce), so a rank waiting at that number sees the mismatch. */
size_t hccl_fast_seg_size(size_t max_bytes);
/* the addresses inside a segment: what Python reads to name a mismatch and to wake a sleeper */
uint64_t *hccl_fast_word(char *seg, int which);
/* 0: mapped count, 1: waiting flag, 2: published count (the others: fastpath.py) */
char *hccl_fast_slot(char *seg, uint64_t k);
/* the slot's header (4 words), data at + 4096 */
uint64_t *hccl_fast_announce_entry(char *seg, uint64_t seq);
/* Publish operation k of rank `me` with fingerprint (w0, w1, w2, w3) (nbytes of src, may be 0). Returns a bit
 * mask of the peers (ranks < 64) whose waiting flag is up (they sleep and need a wake-up), all bits when
 * n > 64 and any is up. */
uint64_t hccl_fast_post(char **segs, int n, int me, uint64_t k, uint64_t w0, uint64_t w1, uint64_t w2, uint64_t w3,
                        const void *src, size_t nbytes);
/* Wait (spin up to spin_ns, then sched_yield up to yield_ns) until every rank published operation k with
 * the fingerprint of this rank's (which must be published). Returns -1 when all did; -2 when the time ran
 * out; r >= 0 when rank r published a different fingerprint at k or announced another collective at that
 * sequence number. */
int hccl_fast_wait(char **segs, int n, int me, uint64_t k, uint64_t spin_ns, uint64_t yield_ns);
/* Record that this rank runs the collective numbered w0 off the fast path (words as for hccl_fast_post). */
void hccl_fast_announce(char *seg, uint64_t w0, uint64_t w1, uint64_t w2, uint64_t w3);
/* dst = the reduction, in rank order, of the n ranks' data of operation k (count elements from byte
 * `offset` of each slot). Returns 0, or -1 for an unknown dtype/op. */
int hccl_fast_reduce(void *dst, char **segs, int n, uint64_t k, size_t offset, size_t count, int dtype, int op);
/* One small all_reduce in place (w3 of its fingerprint is -1, op 4 is avg): post `buf` as operation k with
 * sequence number `seq`, then, unless a peer sleeps, wait as hccl_fast_wait and reduce into buf. Returns -1:
 * done; -3: posted, but the peers in *mask sleep (wake them, then hccl_fast_wait and hccl_fast_reduce);
 * -2: posted, the wait ran out; r >= 0: posted, rank r disagrees; -4: unknown dtype or op (nothing posted
 * when the dtype or op code is out of range). */
int hccl_fast_all_reduce(char **segs, int n, int me, uint64_t k, uint64_t seq, uint64_t count, void *buf,
                         int dtype, int op, uint64_t spin_ns, uint64_t yield_ns, uint64_t *mask);
/* A large all_reduce in place as fast operations k0, k0 + 1, ...: piece i, elements [i * piece, (i + 1) *
 * piece) of buf, is operations k0 + 2i (each rank posts the parts of the piece that the others own; rank r owns
 * the r-th of n 64-byte aligned parts) and k0 + 2i + 1 (each rank posts its part, reduced from its buffer and
 * the peers' slots, then copies the peers' reduced parts into buf). Both carry the collective's fingerprint
 * (seq, all_reduce | dtype | op, count of the whole buffer, -1 and -2). *state (0 at the start) is
 * 2 * (operations done) + 1 while the next operation is posted and not yet waited for; a call goes on from it
 * and starts at most max_pieces pieces. Returns -1: all done; -5: max_pieces pieces done, call again; -3: an
 * operation posted, the peers in *mask sleep (wake them, call again); -2: the wait for a posted operation ran
 * out (wait as hccl_fast_wait, call again); r >= 0: rank r disagrees at the posted operation; -4: unknown dtype
 * or op. */
int hccl_fast_all_reduce_pieces(char **segs, int n, int me, uint64_t k0, uint64_t seq, uint64_t count, void *buf,
                                int dtype, int op, uint64_t piece, uint64_t max_pieces, uint64_t spin_ns,
                                uint64_t yield_ns, uint64_t *mask, uint64_t *state);
/* A large reduce_scatter (count: each rank's block, of the input's n) and a large all_gather (count: each rank's
 * input, of the output's n), one fast operation per piece of `piece` elements of every block, numbered from k0;
 * returns and *state as hccl_fast_all_reduce_pieces. reduce_scatter: every rank copies the piece of each peer's
 * block into its slot (block q at q * piece), then reduces its own block's piece from its input and the peers'
 * slots, own first and then the peers in rank order, into out. all_gather: every rank posts its input's piece,
 * then copies the peers' pieces into their blocks of out (its own block is the caller's to fill). */
int hccl_fast_reduce_scatter_pieces(char **segs, int n, int me, uint64_t k0, uint64_t seq, uint64_t count,
                                    const void *in, void *out, int dtype, int op, uint64_t piece,
                                    uint64_t max_pieces, uint64_t spin_ns, uint64_t yield_ns, uint64_t *mask,
                                    uint64_t *state);
int hccl_fast_all_gather_pieces(char **segs, int n, int me, uint64_t k0, uint64_t seq, uint64_t count,
                                const void *in, void *out, int dtype, uint64_t piece, uint64_t max_pieces,
                                uint64_t spin_ns, uint64_t yield_ns, uint64_t *mask, uint64_t *state);
/* The single-copy all_reduce (fastpath.py), for a large all_reduce in place where the kernel lets the ranks copy
 * between their processes (cross-memory attach: process_vm_readv/writev, the single copy of Open MPI's vader):
 * it runs between fast operations k (every rank posted its buffer's address) and k + 1 (every rank is done
 * writing into the others' buffers). Rank r reduces the r-th of n 64-byte aligned parts of the whole buffer,
 * chunk bytes at a time: it reads the chunk from every peer's buffer into tmp, reduces it into its own buffer
 * (its own elements first, then the peers' in rank order; one rank computes each element, so every rank gets
 * the same bits; op 4 is avg), and writes the result into every peer's buffer. pids[q], addrs[q]: rank q's
 * process and buffer. *state (0 at the start) counts the bytes of the part done; a call does at most max_chunks
 * chunks. While it runs, this rank's busy word is k + 1, and it reads every peer's abandoned word before each
 * chunk. Returns -1: the part is done; -5: max_chunks done, call again; -6: rank *bad abandoned the operation
 * (nothing more was written); -7: the kernel refused a copy from or to rank *bad (*err: its errno); -4: unknown
 * dtype or op; -8: this build has no cross-memory attach (not Linux). */
int hccl_fast_all_reduce_cma(char **segs, int n, int me, uint64_t k, const int64_t *pids, const uint64_t *addrs,
                             uint64_t count, void *buf, int dtype, int op, void *tmp, uint64_t chunk,
                             uint64_t max_chunks, uint64_t *state, int *bad, int *err);
/* The single-copy reduce_scatter (reduce 1) and all_gather (reduce 0), read only from the peers' inputs (addrs[q]:
 * rank q's input): reduce_scatter reduces this rank's block, own first and then the peers in rank order, through
 * tmp (chunk bytes) into out; all_gather copies each peer's input into its block of out (its own is the caller's).
 * At most max_chunks chunks per call, from *state (bytes done). -1: done; -5: call again; -7: copying from rank
 * *bad failed with errno *err; -4: unknown dtype or op; -8: no cross-memory attach here. */
int hccl_fast_gather_cma(int n, int me, const int64_t *pids, const uint64_t *addrs, uint64_t count, const void *in,
                         void *out, int dtype, int op, int reduce, void *tmp, uint64_t chunk, uint64_t max_chunks,
                         uint64_t *state, int *bad, int *err);
/* Whether this process may copy to and from process pid: reads 8 bytes at addr there, and only when they equal
 * expect (a cookie: the process it means, not another with that pid) writes them back. 1: both worked. */
int hccl_cma_probe(int64_t pid, uint64_t addr, uint64_t expect);
/* Leave single-copy operation k before it ended: raise this rank's abandoned word, then wait (at most wait_ns)
 * until no peer is inside hccl_fast_all_reduce_cma for k (a peer that died there counts as out), so that none
 * writes into this rank's buffer after the return. -1, or the first peer still inside when the time ran out. */
int hccl_fast_abandon(char **segs, int n, int me, uint64_t k, const int64_t *pids, uint64_t wait_ns);
/* monotonic clock (CLOCK_MONOTONIC) in nanoseconds */
uint64_t hccl_now_ns(void);
/* a short, static string describing the build: compiler, whether target_clones is active, which
 * kernel clone this CPU runs, how float16 is converted */
const char *hccl_build_info(void);

/* ---- TCP payload pumps (issue 16 item 2) ---------------------------------------------------------
 * A pump is one native thread that moves one payload at a time over a non-blocking socket with no GIL
 * and no Python: the event loop submits a job and learns that it ended through an eventfd it watches
 * (hccl_pump_notify_fd), so a send and a receive run on two cores at once. One job at a time per pump.
 * hccl_pump_new: NULL if the thread or the eventfds could not be made (the caller keeps to its loop path).
 * hccl_pump_submit: dir 0 sends head[hlen] then body[n] (one sendmsg per wake-up, MSG_NOSIGNAL); dir 1
 *   receives exactly n bytes into body. Returns 0, or -1 when a job is still in flight.
 * hccl_pump_stop: the job in flight ends soon (HCCL_PUMP_STOPPED), with an exact byte count.
 * hccl_pump_reap: if the job ended, clears the notification, writes its byte count and returns its
 *   result (0 done, HCCL_PUMP_EOF, HCCL_PUMP_STOPPED, or -errno); HCCL_PUMP_BUSY while it runs.
 * hccl_pump_quit: stops the job in flight and joins the thread (hccl_pump_reap then gives the job's end);
 *   no job runs after it. hccl_pump_free: quits if not yet done, closes the eventfds, frees. */
#define HCCL_PUMP_BUSY 1
#define HCCL_PUMP_EOF 2
#define HCCL_PUMP_STOPPED 3
typedef struct hccl_pump hccl_pump;
hccl_pump *hccl_pump_new(void);
int hccl_pump_notify_fd(hccl_pump *p);
int hccl_pump_submit(hccl_pump *p, int fd, int dir, const void *head, size_t hlen, void *body, size_t n);
void hccl_pump_stop(hccl_pump *p);
int hccl_pump_reap(hccl_pump *p, size_t *done);
void hccl_pump_quit(hccl_pump *p);
void hccl_pump_free(hccl_pump *p);

/* ---- stream-order words (hetccl/gpu/streamorder.py) ----------------------------------------------
 * hccl_words_wait: the watcher's look at the 32-bit words that GPU streams store into host memory, with no
 * GIL. Waits until word *addrs[i] reaches generation gens[i] for some i (serial comparison: the word minus
 * the generation, as int32, is >= 0), or *bump differs from seen (new waits to look at), or timeout_ns
 * passes: looking between sched_yield calls for the first yield_ns, then sleeping pause_ns between looks (the
 * calling thread's timer slack is set to 1 ns at its first call). Returns that i, HCCL_WORDS_BUMPED or
 * HCCL_WORDS_TIMEOUT. */
#define HCCL_WORDS_TIMEOUT -1
#define HCCL_WORDS_BUMPED -2
int hccl_words_wait(const uint64_t *addrs, const uint32_t *gens, int n, const uint32_t *bump, uint32_t seen,
                    uint64_t yield_ns, uint64_t pause_ns, uint64_t timeout_ns);

/* ---- a batch of stream operations (hetccl/bindings/streamops.py StreamBatch) -------------------------
 * hccl_stream_batch: enqueues n operations, each 5 uint64 in `ops` (kind, stream, a, b, c), through the GPU
 * driver's own functions, given by address (so that this library links no GPU runtime): kind
 * HCCL_OP_COPY copies c bytes from b to a (unified addresses), HCCL_OP_WRITE stores the 32-bit value b at
 * device address a, HCCL_OP_WAIT makes the stream wait until the word at a reaches b (as int32, word - b
 * >= 0). vendor HCCL_VENDOR_CUDA: cuMemcpyAsync, cuStreamWriteValue32(_v2), cuStreamWaitValue32(_v2);
 * HCCL_VENDOR_HIP: hipMemcpyAsync, hipStreamWriteValue32, hipStreamWaitValue32. Stops at the first
 * operation the driver refuses: returns its index and stores the driver's code in *rc; -1 when all went. One
 * call, instead of a Python call per operation, for the few hundred an ordered collective enqueues. */
#define HCCL_OP_COPY 0
#define HCCL_OP_WRITE 1
#define HCCL_OP_WAIT 2
#define HCCL_VENDOR_CUDA 0
#define HCCL_VENDOR_HIP 1
int64_t hccl_stream_batch(const uint64_t *ops, int64_t n, int vendor, uint64_t copy_fn, uint64_t write_fn,
                          uint64_t wait_fn, int *rc);
