// matmul.wgsl — batched C[b] = op(A[b]) @ op(B[b]) (needs the math prelude: fma_c, cast).
// a: (batch, m, k) or, with trans_a, (batch, k, m); b: (batch, k, n) or, with
// trans_b, (batch, n, k); a batch stride of 0 broadcasts one matrix -> c: (batch, m, n).
// With prm.add, e: (batch, m, n) is added to the outputs: c = e + round(acc).
//
// The contract, per output: acc = +0.0; for p in 0..k ascending:
// acc = fma(round(a[i,p]), round(b[p,j]), acc); c = round(acc). Each
// invocation owns an 8x8 tile of outputs (8 rows x two vec4s of columns) and
// runs the whole k loop itself: tiles split rows and columns, never k. No
// shared memory and no barriers (on lavapipe they cost more than they save).
// Out-of-range rows/columns load a clamped in-range element and are never
// stored, so ragged shapes need no padding.
//
// Why 8x8: llvmpipe runs 8 invocations as one AVX2 vector, but every
// storage-buffer load is a per-lane scalar loop there, so the cost is the
// number of loads per fma: 16 loads (8 of A, 8 of B) feed 64 fmas per k step.
// The format, the mask and the 16-bit operands are pipeline constants, so the
// inner loop has no branches. The rows are loops (two rows a step in the k
// loop, one in the loads and stores of the sums), not written out: llvmpipe
// inlines every call and expands every load per lane, and the time it takes
// to compile a pipeline grows faster than its code (8 rows written out took
// about 3 times as long, and every process compiles every pipeline it uses
// afresh). The sums stay in named registers, rotated a row or two each step,
// never an indexed array: indexing one puts it in memory (bf16 products ran
// 3 times slower so on lavapipe).

struct MatmulParams {
    m: u32,
    k: u32,
    n: u32,
    trans_a: u32,  // 1: A is stored (batch, k, m) (matmul_tiled stages by TRANS_A)
    trans_b: u32,  // 1: B is stored (batch, n, k) (matmul_tiled stages by TRANS_B)
    fmt: u32,      // unused by the kernels (see FMT)
    batch0: u32,   // first batch of this dispatch (grids are split at 65535)
    p0: u32,       // this pass covers p in [p0, p1): see below
    p1: u32,
    last: u32,     // 1 on the pass that ends at k: it rounds and stores the result
    add: u32,      // 1: the last pass stores e + round(acc) (see e)
    // Where each operand's matrices lie (MatmulDims::placements): matrix bi
    // at (bi / heads) * bs + (bi % heads) * hs, its rows (as stored) ld
    // elements apart. Dense: heads 1, bs the batch stride (0 = broadcast).
    heads: u32,
    a_bs: u32,
    a_hs: u32,
    a_ld: u32,
    b_bs: u32,
    b_hs: u32,
    b_ld: u32,
    c_bs: u32,
    c_hs: u32,
    c_ld: u32,
    keep_n: u32,   // KEEP: A's values (the matrices of A, dense, one after another)
    split: u32,    // PAIR: the row blocks of the grid's first product (see enter)
    zero: u32,     // 0: sep's operand (A_SWIGLU), and in the row loop's bound, which must not be unrolled
    w2: u32,       // A_SWIGLU with keep: where up's words start in c2
}

// Lavapipe (llvmpipe) silently stops a shader after 65,535 loop iterations, so
// the host splits a long k into passes: a pass after the first starts from the
// unrounded running sums the previous one stored in c, and only the last pass
// rounds. Every output still accumulates p = 0, 1, ..., k-1 in order.

// prms[0] is the dispatch's product; with PAIR, prms[1] is a second one (see
// enter). The entry points copy their workgroup's to prm.
@group(0) @binding(0) var<storage, read> prms: array<MatmulParams, 2>;
var<private> prm: MatmulParams;
// a and b are read as bits: float32 values, or with A_HALF / B_HALF words of
// two 16-bit patterns (value e in the low half of word e / 2 for even e).
@group(0) @binding(1) var<storage, read> a: array<u32>;
@group(0) @binding(2) var<storage, read> b: array<u32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
// The addend (prm.add); without it the host binds another operand here, unread.
@group(0) @binding(4) var<storage, read> e: array<f32>;
// With OUTS 2 or 3, batch 1's output is c1 and batch 2's c2 (float32 bits),
// each from its own start (the host sets c_bs to 0): one A times several B (a
// layer's weights laid side by side) writing separate tensors. Otherwise c
// stands in, unused.
@group(0) @binding(5) var<storage, read_write> c1: array<f32>;
@group(0) @binding(6) var<storage, read_write> c2: array<u32>;
override OUTS: u32 = 1u;
// With KEEP, A's values rounded to that format as 16-bit words (pack.wgsl's
// layout): the copy autograd keeps of an activation a product reads. Otherwise
// c stands in, unused.
//
// A_SWIGLU: A is SwiGLU's output, computed as it is loaded: value e is
// swiglu_of(a[e], c1[e]) (gate in a, up in c1, both float32 values of one
// layout), the SwiGLU kernel's bits. With KEEP, keep_a also writes the
// gate's and up's words into c2 (the gate's from 0, up's from prm.w2): the
// copies SwiGLU's backward reads. One output, no pair: c1 and c2 are free.
@group(0) @binding(7) var<storage, read_write> a_words: array<u32>;
// PAIR: the grid runs two products over one A, prms[0]'s in its first
// prms[0].split row blocks and prms[1]'s in the rest (a product's two
// gradients, dA = dC·B and dB = dCᵀ·A, each from dC): the second reads its B
// from c2 (as B2_HALF says), its addend from a_words (float32 bits) and
// writes c1. Each output is its own product's chain, whichever dispatch runs
// it.
override PAIR: bool = false;
var<private> second: bool = false;

// Makes prms[s] this workgroup's product (s = 1: a pair's second).
fn enter(s: u32) {
    prm = prms[s];
    if PAIR && s == 1u {
        second = true;
        c_slot = 1u;
    }
}
// The output binding of this invocation's batch (see place).
var<private> c_slot: u32 = 0u;

fn c_get(at: u32) -> f32 {
    if (OUTS > 1u || PAIR) && c_slot == 1u {
        return c1[at];
    }
    if OUTS > 2u && c_slot == 2u {
        return bitcast<f32>(c2[at]);
    }
    return c[at];
}

fn c_set(at: u32, x: f32) {
    if (OUTS > 1u || PAIR) && c_slot == 1u {
        c1[at] = x;
    } else if OUTS > 2u && c_slot == 2u {
        c2[at] = bitcast<u32>(x);
    } else {
        c[at] = x;
    }
}

// Pipeline specialisation (one pipeline per combination, compiled on first
// use): what changes the inner loop's work. FMT is the FMT_* code applied to
// operands as loaded and to the output. The layouts are runtime parameters in
// `matmul` (they only set the strides, loop invariants); matmul_tiled stages
// its tiles in a layout's coalesced order, so there they are TRANS_A / TRANS_B
// as well (the host sets them for that variant alone: every other value of
// these two would compile `matmul` again for nothing).
override FMT: u32 = 0u;
override TRANS_A: bool = false;
override TRANS_B: bool = false;
// CAUSAL is the Causal code (backend/matmul/mod.rs): 0 the whole product;
// 1 outputs (i, j > i) are +0; 2 row i sums terms p <= i; 3 terms p >= i.
// Left-out terms are skipped (selected away), never added as zeros, and the
// p loop covers only the terms some row of the tile sums.
override CAUSAL: u32 = 0u;
// A_HALF / B_HALF: the FMT_* code of an operand kept in 16-bit storage (0: its
// buffer holds float32 values). Its values are widened exactly as they are
// loaded, so the product is the one over the unpacked buffer.
override A_HALF: u32 = 0u;
override B_HALF: u32 = 0u;
// A pair's second B (a weight's gradient reads the activation's 16-bit copy
// where the input's reads the float32 weight).
override B2_HALF: u32 = 0u;
override A_SWIGLU: bool = false;
// KEEP: the FMT_* code of the 16-bit copy of A that keep_a writes (0: none).
// A constant, so the products that keep no copy (most) compile no copying.
override KEEP: u32 = 0u;

// Value e of A and of B.
fn load_a(e: u32) -> f32 {
    if A_SWIGLU {
        return swiglu_of(bitcast<f32>(a[e]), c1[e], prm.zero);
    }
    if A_HALF == 0u {
        return bitcast<f32>(a[e]);
    }
    return half_value(a[e / 2u], e, A_HALF);
}

fn load_b(e: u32) -> f32 {
    if PAIR && second {
        if B2_HALF == 0u {
            return bitcast<f32>(c2[e]);
        }
        return half_value(c2[e / 2u], e, B2_HALF);
    }
    if B_HALF == 0u {
        return bitcast<f32>(b[e]);
    }
    return half_value(b[e / 2u], e, B_HALF);
}

fn kept(i: u32, p: u32) -> bool {
    if CAUSAL == 2u {
        return p <= i;
    }
    if CAUSAL == 3u {
        return p >= i;
    }
    return true;
}

// Where the device's own fma may run a chain: exact.wgsl.
// Set by the launcher (matmul/gpu.rs `guarded`), which also keeps a guarded
// pass to GUARD_PASS terms.
override GUARD: bool = false;

fn fma4(x: f32, y: vec4<f32>, acc: vec4<f32>) -> vec4<f32> {
    if FMT != 0u {
        return fma(vec4<f32>(x), y, acc);
    }
    return fma4_c(x, y, acc);
}

// Stores the columns j, j + s, j + 2s, j + 3s of output row i (at offset
// `row`) that lie inside the matrix, rounded (and with prm.add added to e) on the
// last pass, raw running sums before it; with CAUSAL 1 the columns past the
// diagonal are +0.
fn store_lanes(row: u32, i: u32, j: u32, s: u32, v: vec4<f32>) {
    let n = prm.n;
    let cols = vec4<u32>(j, j + s, j + 2u * s, j + 3u * s);
    var w = v;
    if CAUSAL == 1u {
        w = select(v, vec4<f32>(0.0), cols > vec4<u32>(i));
    }
    if cols.x < n {
        c_set(row + cols.x, fin(w.x, row + cols.x));
    }
    if cols.y < n {
        c_set(row + cols.y, fin(w.y, row + cols.y));
    }
    if cols.z < n {
        c_set(row + cols.z, fin(w.z, row + cols.z));
    }
    if cols.w < n {
        c_set(row + cols.w, fin(w.w, row + cols.w));
    }
}

// Output `at`'s value to store from its running sum x.
fn fin(x: f32, at: u32) -> f32 {
    if prm.last == 0u {
        return x;
    }
    // the product's bits and then the elementwise sum's (gradient
    // accumulation without a separate add)
    if prm.add != 0u {
        if PAIR && second {
            return bitcast<f32>(a_words[at]) + rnd(x);
        }
        return e[at] + rnd(x);
    }
    return rnd(x);
}

// The running sums of columns j, j + s, j + 2s, j + 3s of one output row left
// by the previous pass (zero on the first pass, and outside the matrix).
fn load_lanes(row: u32, j: u32, s: u32) -> vec4<f32> {
    let n = prm.n;
    let cols = vec4<u32>(j, j + s, j + 2u * s, j + 3u * s);
    var v = vec4<f32>(0.0);
    if prm.p0 == 0u {
        return v;
    }
    if cols.x < n {
        v.x = c_get(row + cols.x);
    }
    if cols.y < n {
        v.y = c_get(row + cols.y);
    }
    if cols.z < n {
        v.z = c_get(row + cols.z);
    }
    if cols.w < n {
        v.w = c_get(row + cols.w);
    }
    return v;
}

fn rnd(x: f32) -> f32 {
    if FMT == 0u {
        return x;
    }
    return round_fmt(x, FMT);
}

// Where batch bi's matrices lie: A's element (i, p) at a_base + i * ia +
// p * pa, B's (p, j) at b_base + p * pb + j * jb, C's (i, j) (and the addend's) at
// c_base + i * prm.c_ld + j.
struct Place {
    a_base: u32,
    b_base: u32,
    c_base: u32,
    ia: u32,
    pa: u32,
    pb: u32,
    jb: u32,
}

fn place(bi: u32) -> Place {
    if OUTS > 1u {
        c_slot = bi;
    }
    let outer = bi / prm.heads;
    let inner = bi % prm.heads;
    var q: Place;
    q.a_base = outer * prm.a_bs + inner * prm.a_hs;
    q.b_base = outer * prm.b_bs + inner * prm.b_hs;
    q.c_base = outer * prm.c_bs + inner * prm.c_hs;
    q.ia = prm.a_ld;
    q.pa = 1u;
    if prm.trans_a != 0u {
        q.ia = 1u;
        q.pa = prm.a_ld;
    }
    q.pb = prm.b_ld;
    q.jb = 1u;
    if prm.trans_b != 0u {
        q.pb = 1u;
        q.jb = prm.b_ld;
    }
    return q;
}

// KEEP: the workgroups of the first column block write A's words, each
// those whose first value lies in its 64 rows of its matrix (a broadcast A is
// matrix 0 alone), from the buffer's values: the words pack.wgsl writes. The
// host asks only for a dense, unpacked, untransposed A. No barriers, and
// nothing else reads `a_words`, so where this runs changes nothing else.
fn keep_a(wg: vec3<u32>, lane: u32, lanes: u32) {
    if KEEP == 0u || prm.last == 0u || wg.x != 0u {
        return;
    }
    let mk = prm.m * prm.k;
    let bi = prm.batch0 + wg.z;
    if bi >= prm.keep_n / mk {
        return;
    }
    let first = bi * mk;
    let r0 = wg.y * 64u;
    let start = first + r0 * prm.k;
    let end = first + min(r0 + 64u, prm.m) * prm.k;
    for (var w = (start + 1u) / 2u + lane; w < (end + 1u) / 2u; w += lanes) {
        let e = 2u * w;
        let two = e + 1u < prm.keep_n;
        a_words[w] = word_of(load_a(e), load_a(min(e + 1u, prm.keep_n - 1u)), two);
        if A_SWIGLU {
            c2[w] = word_of(bitcast<f32>(a[e]), bitcast<f32>(a[e + u32(two)]), two);
            c2[prm.w2 + w] = word_of(c1[e], c1[e + u32(two)], two);
        }
    }
}

// The word of values x (low half) and, where `two`, y, rounded to KEEP.
fn word_of(x: f32, y: f32, two: bool) -> u32 {
    var bits = half_bits(x, KEEP);
    if two {
        bits = bits | (half_bits(y, KEEP) << 16u);
    }
    return bits;
}

const ROWS: u32 = 8u;
const COLS: u32 = 8u;

// grid: (ceil(n / (8 COLS)), ceil(m / (8 ROWS)), batches); workgroup 8x8 invocations of ROWS x COLS outputs.
@compute @workgroup_size(8, 8, 1)
fn matmul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>,
          @builtin(local_invocation_index) li: u32) {
    // a pair's second product: its own row blocks from 0
    let s = select(0u, 1u, PAIR && wg.y >= prms[0].split);
    enter(s);
    let y = gid.y - s * prms[0].split * 8u;
    keep_a(wg, li, 64u);
    let m = prm.m;
    let n = prm.n;
    let k = prm.k;
    let i0 = y * ROWS;
    let j0 = gid.x * COLS;
    if i0 >= m || j0 >= n {
        return;
    }
    let q = place(prm.batch0 + gid.z);
    let a_base = q.a_base;
    let b_base = q.b_base;
    let ia = q.ia;
    let pa = q.pa;
    let pb = q.pb;
    let jb = q.jb;
    // start offsets of the tile's columns of B, clamped to the matrix (loads past the edge are dropped)
    let bc0 = b_base + min(j0 + 0u, n - 1u) * jb;
    let bc1 = b_base + min(j0 + 1u, n - 1u) * jb;
    let bc2 = b_base + min(j0 + 2u, n - 1u) * jb;
    let bc3 = b_base + min(j0 + 3u, n - 1u) * jb;
    let bc4 = b_base + min(j0 + 4u, n - 1u) * jb;
    let bc5 = b_base + min(j0 + 5u, n - 1u) * jb;
    let bc6 = b_base + min(j0 + 6u, n - 1u) * jb;
    let bc7 = b_base + min(j0 + 7u, n - 1u) * jb;
    let out = q.c_base;
    let ldc = prm.c_ld;
    // The tile's rows inside the matrix (no other is stored) and their running
    // sums (row r's columns j0..j0+3 and j0+4..j0+7: accR_0 and accR_1),
    // zero on the first pass, the previous pass's after it.
    let rows = min(ROWS, m - i0);
    var acc0_0 = vec4<f32>(0.0);
    var acc0_1 = vec4<f32>(0.0);
    var acc1_0 = vec4<f32>(0.0);
    var acc1_1 = vec4<f32>(0.0);
    var acc2_0 = vec4<f32>(0.0);
    var acc2_1 = vec4<f32>(0.0);
    var acc3_0 = vec4<f32>(0.0);
    var acc3_1 = vec4<f32>(0.0);
    var acc4_0 = vec4<f32>(0.0);
    var acc4_1 = vec4<f32>(0.0);
    var acc5_0 = vec4<f32>(0.0);
    var acc5_1 = vec4<f32>(0.0);
    var acc6_0 = vec4<f32>(0.0);
    var acc6_1 = vec4<f32>(0.0);
    var acc7_0 = vec4<f32>(0.0);
    var acc7_1 = vec4<f32>(0.0);
    // after the first pass, the previous one's: row r loaded into acc7_*
    // at step r while the rows before it move up one
    for (var r = 0u; r < select(0u, ROWS, prm.p0 != 0u); r++) {
        acc0_0 = acc1_0;
        acc0_1 = acc1_1;
        acc1_0 = acc2_0;
        acc1_1 = acc2_1;
        acc2_0 = acc3_0;
        acc2_1 = acc3_1;
        acc3_0 = acc4_0;
        acc3_1 = acc4_1;
        acc4_0 = acc5_0;
        acc4_1 = acc5_1;
        acc5_0 = acc6_0;
        acc5_1 = acc6_1;
        acc6_0 = acc7_0;
        acc6_1 = acc7_1;
        let row = out + min(i0 + r, m - 1u) * ldc;
        acc7_0 = load_lanes(row, j0, 1u);
        acc7_1 = load_lanes(row, j0 + 4u, 1u);
    }
    // The terms some row of the tile sums (CAUSAL 1 tiles wholly past the
    // diagonal sum none: all +0).
    var p_lo = prm.p0;
    var p_hi = prm.p1;
    if CAUSAL == 1u && j0 > i0 + ROWS - 1u {
        p_hi = p_lo;
    }
    if CAUSAL == 2u {
        p_hi = min(p_hi, i0 + ROWS);
    }
    if CAUSAL == 3u {
        p_lo = max(p_lo, i0);
    }
    var sa = no_span();
    var sb = no_span();
    var pa_off = p_lo * pa;
    var pb_off = p_lo * pb;
    for (var p = p_lo; p < p_hi; p++) {
        let b0 = vec4<f32>(rnd(load_b(bc0 + pb_off)), rnd(load_b(bc1 + pb_off)), rnd(load_b(bc2 + pb_off)), rnd(load_b(bc3 + pb_off)));
        let b1 = vec4<f32>(rnd(load_b(bc4 + pb_off)), rnd(load_b(bc5 + pb_off)), rnd(load_b(bc6 + pb_off)), rnd(load_b(bc7 + pb_off)));
        if GUARD {
            sb = span_add(sb, b0);
            sb = span_add(sb, b1);
        }
        // Rows r and r + 1 (past the matrix, its last row again: never
        // stored) work on acc0_* and acc1_*; then every row's sums move up
        // two (those two to the end), so after the four steps each row is
        // back in its own.
        for (var r = 0u; r < ROWS + prm.zero; r += 2u) {
            let x0 = rnd(load_a(a_base + min(i0 + r, m - 1u) * ia + pa_off));
            let x1 = rnd(load_a(a_base + min(i0 + r + 1u, m - 1u) * ia + pa_off));
            if GUARD {
                sa = span_add(sa, vec4<f32>(x0, x1, x0, x1));
            }
            let n0_0 = select(acc0_0, fma4(x0, b0, acc0_0), kept(i0 + r, p));
            let n0_1 = select(acc0_1, fma4(x0, b1, acc0_1), kept(i0 + r, p));
            let n1_0 = select(acc1_0, fma4(x1, b0, acc1_0), kept(i0 + r + 1u, p));
            let n1_1 = select(acc1_1, fma4(x1, b1, acc1_1), kept(i0 + r + 1u, p));
            acc0_0 = acc2_0;
            acc0_1 = acc2_1;
            acc1_0 = acc3_0;
            acc1_1 = acc3_1;
            acc2_0 = acc4_0;
            acc2_1 = acc4_1;
            acc3_0 = acc5_0;
            acc3_1 = acc5_1;
            acc4_0 = acc6_0;
            acc4_1 = acc6_1;
            acc5_0 = acc7_0;
            acc5_1 = acc7_1;
            acc6_0 = n0_0;
            acc6_1 = n0_1;
            acc7_0 = n1_0;
            acc7_1 = n1_1;
        }
        pa_off += pa;
        pb_off += pb;
    }
    // Where some product may not have been exact, each row's chains again
    // with fma_c, from the running sums in memory: a loop no lane enters
    // costs nothing, where a branch's both sides may run. A guarded pass is at
    // most GUARD_PASS terms (the launcher's), so these loops and the one above
    // stay under lavapipe's iteration cap together.
    var redo = false;
    if GUARD {
        redo = !exact_products(span_exponents(sa), span_exponents(sb));
        for (var r = select(rows, 0u, redo); r < rows; r++) {
            let i = i0 + r;
            let row = out + i * ldc;
            var s0 = load_lanes(row, j0, 1u);
            var s1 = load_lanes(row, j0 + 4u, 1u);
            var pa_at = a_base + i * ia + p_lo * pa;
            var pb_at = p_lo * pb;
            for (var p = p_lo; p < p_hi; p++) {
                let x = rnd(load_a(pa_at));
                let y0 = vec4<f32>(rnd(load_b(bc0 + pb_at)), rnd(load_b(bc1 + pb_at)), rnd(load_b(bc2 + pb_at)), rnd(load_b(bc3 + pb_at)));
                let y1 = vec4<f32>(rnd(load_b(bc4 + pb_at)), rnd(load_b(bc5 + pb_at)), rnd(load_b(bc6 + pb_at)), rnd(load_b(bc7 + pb_at)));
                s0 = select(s0, fma4_c(x, y0, s0), kept(i, p));
                s1 = select(s1, fma4_c(x, y1, s1), kept(i, p));
                pa_at += pa;
                pb_at += pb;
            }
            store_lanes(row, i, j0, 1u, s0);
            store_lanes(row, i, j0 + 4u, 1u, s1);
        }
    }
    if !redo {
        // row r's sums in acc0_* at step r, the rows after it moving up one
        for (var r = 0u; r < rows; r++) {
            let row = out + (i0 + r) * ldc;
            store_lanes(row, i0 + r, j0, 1u, acc0_0);
            store_lanes(row, i0 + r, j0 + 4u, 1u, acc0_1);
            acc0_0 = acc1_0;
            acc0_1 = acc1_1;
            acc1_0 = acc2_0;
            acc1_1 = acc2_1;
            acc2_0 = acc3_0;
            acc2_1 = acc3_1;
            acc3_0 = acc4_0;
            acc3_1 = acc4_1;
            acc4_0 = acc5_0;
            acc4_1 = acc5_1;
            acc5_0 = acc6_0;
            acc5_1 = acc6_1;
            acc6_0 = acc7_0;
            acc6_1 = acc7_1;
        }
    }
}

// ---------------------------------------------------------------------------
// matmul_tiled: the hardware variant (backend/gpu/variant.rs), the same
// contract and bits. A workgroup of 16x16 invocations owns a 64x64 block of
// outputs (the grid of `matmul`); invocation (x, y) owns the 4x4 outputs at
// rows i0 + y + 16 r and columns j0 + x + 16 c (r, c in 0..4), so the
// workgroup's stores of one row are 16 consecutive columns. The k axis is
// walked in tiles of TILE_K terms: the workgroup stages A's 64 x TILE_K and
// B's TILE_K x 64 values in workgroup memory (coalesced: consecutive lanes
// read consecutive addresses of whichever layout the operand has), each value
// rounded once as it is staged; then every invocation runs TILE_K steps of its
// outputs' fma chains from workgroup memory. Each output still accumulates
// p = p0, p0 + 1, ... in order from its own register: the tiles split k into
// consecutive runs of one chain, never the chain itself.
//
// Per invocation and tile: 4 + 4 staged loads (TILE_K x 16 = 256 fmas), so
// one global load per 32 fmas (tests/gpu_parity.rs counts it in the IR).

const TILE_K: u32 = 16u;  // terms staged per tile
const TILE_MN: u32 = 64u; // output rows (and columns) of a workgroup
// A staged row's pitch: one past TILE_MN, so the lanes staging along k write
// to different banks.
const PITCH: u32 = 65u;

// tile_a[kk * PITCH + r] = round(A(i0 + r, t0 + kk)); tile_b[kk * PITCH + c] =
// round(B(t0 + kk, j0 + c)): (TILE_K, TILE_MN) each. Rows and columns past the
// matrix (and terms past k) hold clamped in-range values, never used.
var<workgroup> tile_a: array<f32, 1040>;
var<workgroup> tile_b: array<f32, 1040>;
// GUARD: the workgroup's operand magnitude exponents (A's largest, 255 - A's
// smallest nonzero, B's the same).
var<workgroup> wg_exponents: array<atomic<u32>, 4>;



// Where a workgroup's operands lie: A's element (i, p) at a_base + i * ia +
// p * pa, B's (p, j) at b_base + p * pb + j * jb; its block's first row i0
// and column j0.
struct Tiling {
    m: u32,
    k: u32,
    n: u32,
    i0: u32,
    j0: u32,
    a_base: u32,
    b_base: u32,
    ia: u32,
    pa: u32,
    pb: u32,
    jb: u32,
}

// Stages value e (0..1024) of the A and of the B tile that start at term t0,
// rounded: consecutive lanes read consecutive addresses of whichever layout
// each operand has. Returns the two values staged.
fn stage(g: Tiling, t0: u32, e: u32) -> vec2<f32> {
    // A: along p when p is A's contiguous axis, else along i
    var ra = e / TILE_K;
    var ka = e % TILE_K;
    // a pair's products may lie differently (the host sets no TRANS_*)
    if select(TRANS_A, prm.trans_a != 0u, PAIR) {
        ra = e % TILE_MN;
        ka = e / TILE_MN;
    }
    let va = rnd(load_a(g.a_base + min(g.i0 + ra, g.m - 1u) * g.ia + min(t0 + ka, g.k - 1u) * g.pa));
    tile_a[ka * PITCH + ra] = va;
    // B: along j when j is B's contiguous axis, else along p
    var cb = e % TILE_MN;
    var kb = e / TILE_MN;
    if select(TRANS_B, prm.trans_b != 0u, PAIR) {
        cb = e / TILE_K;
        kb = e % TILE_K;
    }
    let vb = rnd(load_b(g.b_base + min(t0 + kb, g.k - 1u) * g.pb + min(g.j0 + cb, g.n - 1u) * g.jb));
    tile_b[kb * PITCH + cb] = vb;
    return vec2<f32>(va, vb);
}

// grid: (ceil(n / 64), ceil(m / 64), batches); workgroup 16x16 invocations of 4x4 outputs.
@compute @workgroup_size(16, 16, 1)
fn matmul_tiled(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    // everything the loops and barriers depend on is uniform over the
    // workgroup: read from prms here (prm, private, is not known to be)
    let s = select(0u, 1u, PAIR && wg.y >= prms[0].split);
    let pm = prms[s];
    enter(s);
    let m = pm.m;
    let n = pm.n;
    let k = pm.k;
    let i0 = (wg.y - s * prms[0].split) * TILE_MN;
    let j0 = wg.x * TILE_MN;
    if j0 >= n {
        return;
    }
    let q = place(pm.batch0 + wg.z);
    let g = Tiling(m, k, n, i0, j0, q.a_base, q.b_base, q.ia, q.pa, q.pb, q.jb);
    let lane = lid.y * 16u + lid.x;
    // the extremes start from zero (no kernel gets its workgroup memory
    // zeroed: context.rs); stale ones would only send more chains to fma_c
    if GUARD {
        if lane < 4u {
            atomicStore(&wg_exponents[lane], 0u);
        }
        workgroupBarrier();
    }
    keep_a(wg, lane, 256u);
    // this invocation's rows (y + 16 r) and first column (x) in the block
    let r0 = i0 + lid.y;
    let jx = j0 + lid.x;
    let out = q.c_base;
    let ldc = prm.c_ld;
    var acc0 = load_lanes(out + min(r0, m - 1u) * ldc, jx, 16u);
    var acc1 = load_lanes(out + min(r0 + 16u, m - 1u) * ldc, jx, 16u);
    var acc2 = load_lanes(out + min(r0 + 32u, m - 1u) * ldc, jx, 16u);
    var acc3 = load_lanes(out + min(r0 + 48u, m - 1u) * ldc, jx, 16u);
    // The terms some row of the block sums (see matmul).
    var p_lo = pm.p0;
    var p_hi = pm.p1;
    if CAUSAL == 1u && j0 > i0 + TILE_MN - 1u {
        p_hi = p_lo;
    }
    if CAUSAL == 2u {
        p_hi = min(p_hi, i0 + TILE_MN);
    }
    if CAUSAL == 3u {
        p_lo = max(p_lo, i0);
    }
    p_hi = max(p_hi, p_lo);
    var sa = no_span();
    var sb = no_span();
    for (var t0 = p_lo; t0 < p_hi; t0 += TILE_K) {
        // the previous tile is consumed before it is overwritten
        workgroupBarrier();
        // 1,024 values of each operand, 4 per lane (no loop: the load count
        // per tile is fixed, and tests count it)
        let v0 = stage(g, t0, lane);
        let v1 = stage(g, t0, lane + 256u);
        let v2 = stage(g, t0, lane + 512u);
        let v3 = stage(g, t0, lane + 768u);
        if GUARD {
            sa = span_add(sa, vec4<f32>(v0.x, v1.x, v2.x, v3.x));
            sb = span_add(sb, vec4<f32>(v0.y, v1.y, v2.y, v3.y));
        }
        workgroupBarrier();
        let steps = min(TILE_K, p_hi - t0);
        for (var kk = 0u; kk < steps; kk++) {
            let p = t0 + kk;
            let at = kk * PITCH;
            let bv = vec4<f32>(tile_b[at + lid.x], tile_b[at + lid.x + 16u],
                               tile_b[at + lid.x + 32u], tile_b[at + lid.x + 48u]);
            acc0 = select(acc0, fma4(tile_a[at + lid.y], bv, acc0), kept(r0, p));
            acc1 = select(acc1, fma4(tile_a[at + lid.y + 16u], bv, acc1), kept(r0 + 16u, p));
            acc2 = select(acc2, fma4(tile_a[at + lid.y + 32u], bv, acc2), kept(r0 + 32u, p));
            acc3 = select(acc3, fma4(tile_a[at + lid.y + 48u], bv, acc3), kept(r0 + 48u, p));
        }
    }
    // As in `matmul`, each row's chains again with fma_c where some product
    // may not have been exact. Every lane multiplied values other lanes
    // staged, so the workgroup's extremes decide.
    var redo = false;
    if GUARD {
        let ea = span_exponents(sa);
        let eb = span_exponents(sb);
        atomicMax(&wg_exponents[0], ea.x);
        atomicMax(&wg_exponents[1], 255u - ea.y);
        atomicMax(&wg_exponents[2], eb.x);
        atomicMax(&wg_exponents[3], 255u - eb.y);
        workgroupBarrier();
        let wa = vec2<u32>(atomicLoad(&wg_exponents[0]), 255u - atomicLoad(&wg_exponents[1]));
        let wb = vec2<u32>(atomicLoad(&wg_exponents[2]), 255u - atomicLoad(&wg_exponents[3]));
        redo = !exact_products(wa, wb);
        let cols = vec4<u32>(jx, jx + 16u, jx + 32u, jx + 48u);
        let bc = g.b_base + min(cols, vec4<u32>(n - 1u)) * g.jb;
        for (var r = select(4u, 0u, redo); r < 4u; r++) {
            let i = r0 + 16u * r;
            if i < m {
                let row = out + i * ldc;
                var s = load_lanes(row, jx, 16u);
                for (var p = p_lo; p < p_hi; p++) {
                    let x = rnd(load_a(g.a_base + i * g.ia + p * g.pa));
                    let y = vec4<f32>(rnd(load_b(bc.x + p * g.pb)), rnd(load_b(bc.y + p * g.pb)),
                                      rnd(load_b(bc.z + p * g.pb)), rnd(load_b(bc.w + p * g.pb)));
                    s = select(s, fma4_c(x, y, s), kept(i, p));
                }
                store_lanes(row, i, jx, 16u, s);
            }
        }
    }
    if !redo {
        if r0 < m {
            store_lanes(out + r0 * ldc, r0, jx, 16u, acc0);
        }
        if r0 + 16u < m {
            store_lanes(out + (r0 + 16u) * ldc, r0 + 16u, jx, 16u, acc1);
        }
        if r0 + 32u < m {
            store_lanes(out + (r0 + 32u) * ldc, r0 + 32u, jx, 16u, acc2);
        }
        if r0 + 48u < m {
            store_lanes(out + (r0 + 48u) * ldc, r0 + 48u, jx, 16u, acc3);
        }
    }
}
