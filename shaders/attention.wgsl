// attention.wgsl — causal attention: forward in one dispatch, backward in two
// (needs the math prelude, exact.wgsl and rope.wgsl).
// q, k, dq, dk: (heads, T, D); v, y, dy, dv: (heads, T, D), or token-major
// (B, T, h, D) with heads = B·h; p, ds: (heads, T, T) scratch, of which row i
// of a head holds keys j <= i.
// With RoPE, q and k come in token-major like v and are rotated as the
// forward reads them (ROT_LOAD: rope.wgsl's rope_value at the row's position,
// stored as R_FMT says), and the rotated rows are what backward keeps,
// head-major; the backward's dq and dk are stored token-major, each row
// rotated back (AttnParams.rot_back: rope_grad, the arriving gradient first
// stored as r_fmt says) by the invocation that formed it, after its last
// chain. The forward's are pipeline constants (its inner loops read through
// them), the backward's runtime values (a row's last step: the backward
// pipelines serve attention with RoPE and without).
//
// The bits are the batched composition's (attention/mod.rs), each step the
// kernel it stands for:
// * scores (matmul.wgsl, FMT = S_FMT, CAUSAL 1): for keys j <= i,
//   x_j = rnd_s(acc), acc = +0, acc = fma(rnd_s(q[i,p]), rnd_s(k[j,p]), acc)
//   for p = 0..D ascending;
// * softmax_rows (reduce.wgsl), causal: v_j = x_j * scale (x_j when the
//   scale is 1); m = v_0, m = maximum(m, v_j) for j = 1..=i; e_j = exp(v_j -
//   m); s = -0, s = s + e_j ascending; p_j = div(e_j, s), and the masked
//   keys' p_j = div(+0, s);
// * with P_FMT, p is stored in that format (pack.wgsl's words) and read back:
//   p_j = widen(half_bits(p_j));
// * y = p v (FMT = Y_FMT, CAUSAL 2): y[i,c] = rnd_y(acc), acc = +0,
//   acc = fma(rnd_y(p_j), rnd_y(v[j,c]), acc) for j = 0..=i ascending.
// Backward recomputes p, then
// * dp = dy vᵀ (Y_FMT, CAUSAL 1), rounded to P_FMT where it is set (the
//   masked keys' dp = +0);
// * softmax_rows_backward (reduce.wgsl) over all T keys: dot = -0,
//   dot = fma_c(dp_j, p_j, dot) ascending; ds_j = p_j (dp_j - dot), times the
//   scale where it is not 1;
// * dq = ds k (S_FMT, CAUSAL 2), dk = dsᵀ q (S_FMT, CAUSAL 3: key row j sums
//   queries i >= j ascending), dv = pᵀ dy (Y_FMT, CAUSAL 3).
// The masked entries of p, dp and ds are never read by a product, so only
// the dot's terms are formed for them.
//
// One invocation per row (64 rows of one head a workgroup), each running its
// row's chains: the forward and the backward's row pass per query (p, dp, ds
// and dq), the column pass per key (dk and dv); chains along D four keys at
// a time, four terms a step, outputs four columns at a time. No barriers: an
// invocation writes only its own rows, and the column pass reads what the row
// pass wrote. Loop steps per invocation, at most (guarded chains run twice;
// t4 = ⌈T/4⌉, d4 = ⌈D/4⌉): forward 2 t4 (5 + d4) + 3T + 2 d4 (T + 1) + 4 d4
// (D/2 more keeping the words), the row pass 4 t4 (5 + d4) + 5T + 2 d4 (T + 1)
// + 4 d4, the column pass 4 d4 (T + 1) + 8 d4, each backward pass D/2 more
// rotating back; the host keeps them under lavapipe's 65,535
// (attention/gpu.rs).

// A uniform buffer: the forward's eight buffers are all storage ones.
struct AttnParams {
    t: u32,
    d: u32,
    head0: u32,  // first head of this dispatch (grids are split at 65535)
    scale: u32,  // f32 bits
    tokens: u32, // h: v, y and their gradients token-major; 0: (heads, T, D)
    keep: u32,   // attention_keeping: FMT_* code of q's and k's words
    keep_v: u32, // and of v's (0: none written)
    kw: u32,     // where k's words start in at_wqk
    cos_at: u32, // where RoPE's cos and sin tables (T, D) start in at_cs
    sin_at: u32,
    zero: u32,   // +0 (rope.wgsl's sep)
    rot_back: u32, // 1: the backward rotates dq and dk back (RoPE)
    r_fmt: u32,    // and the FMT_* code the rotated values are stored in
}

// q, k and v as bits: float32 values, or with *_HALF words of two 16-bit
// patterns (value e in the low half of word e / 2 for even e).
@group(0) @binding(0) var<uniform> at_prm: AttnParams;
@group(0) @binding(1) var<storage, read> at_q: array<u32>;
// every pass: RoPE's tables (without RoPE, a stand-in never read)
@group(0) @binding(4) var<storage, read> at_cs: array<f32>;
// forward and row pass
@group(0) @binding(2) var<storage, read> at_k: array<u32>;
@group(0) @binding(3) var<storage, read> at_v: array<u32>;
@group(0) @binding(5) var<storage, read_write> at_p: array<f32>;
// forward; attention_keeping also writes q and k (into one buffer, k's from
// kw) and v as 16-bit words (pack.wgsl's), the copies autograd keeps: query
// row i's invocation writes row i of each (D even, so that no word spans two
// rows); with RoPE, q and k rotated, as float32 values where keep is 0
@group(0) @binding(6) var<storage, read_write> at_y: array<f32>;
@group(0) @binding(7) var<storage, read_write> at_wqk: array<u32>;
@group(0) @binding(8) var<storage, read_write> at_wv: array<u32>;
// row pass (and dy, the column pass)
@group(0) @binding(6) var<storage, read_write> ar_ds: array<f32>;
@group(0) @binding(7) var<storage, read> at_dy: array<f32>;
@group(0) @binding(8) var<storage, read_write> ar_dq: array<f32>;
// column pass
@group(0) @binding(2) var<storage, read> ac_p: array<f32>;
@group(0) @binding(3) var<storage, read> ac_ds: array<f32>;
@group(0) @binding(5) var<storage, read_write> ac_dk: array<f32>;
@group(0) @binding(6) var<storage, read_write> ac_dv: array<f32>;

// The FMT_* codes of the scores' products (q kᵀ, ds k, dsᵀ q), of those with
// v and dy, and of p's storage (0: float32); of q, k and v kept in 16-bit
// storage (0: float32 values); and whether each kind of product runs guarded
// (exact.wgsl; set by the launcher as for the matmul).
override S_FMT: u32 = 0u;
override Y_FMT: u32 = 0u;
override P_FMT: u32 = 0u;
override Q_HALF: u32 = 0u;
override K_HALF: u32 = 0u;
override V_HALF: u32 = 0u;
override S_GUARD: bool = false;
override Y_GUARD: bool = false;
// RoPE in the forward: q and k rotated as they are read (token-major), and
// the FMT_* code the rotated values are stored in (0: float32)
override ROT_LOAD: bool = false;
override R_FMT: u32 = 0u;

fn load_q(e: u32) -> f32 {
    if Q_HALF == 0u {
        return bitcast<f32>(at_q[e]);
    }
    return half_value(at_q[e / 2u], e, Q_HALF);
}

fn load_k(e: u32) -> f32 {
    if K_HALF == 0u {
        return bitcast<f32>(at_k[e]);
    }
    return half_value(at_k[e / 2u], e, K_HALF);
}

fn load_v(e: u32) -> f32 {
    if V_HALF == 0u {
        return bitcast<f32>(at_v[e]);
    }
    return half_value(at_v[e / 2u], e, V_HALF);
}

fn rnd_r(x: f32) -> f32 {
    if R_FMT == 0u {
        return x;
    }
    return round_fmt(x, R_FMT);
}

// Element c of the token-major row at `row` (the row's element and its
// partner as `pair` gives them) rotated at the row's position and stored as
// R_FMT says.
fn rotated(row: u32, c: u32, pair: vec2<f32>) -> f32 {
    let d = at_prm.d;
    let e = (row / (at_prm.tokens * d)) % at_prm.t * d + c; // the tables' entry
    let r = rope_value(pair.x, pair.y, at_cs[at_prm.cos_at + e], at_cs[at_prm.sin_at + e], c < d / 2u, at_prm.zero);
    return rnd_r(r);
}

// Where element c's partner is in its row: c + D/2 in the first half, c -
// D/2 in the second.
fn partner(c: u32) -> u32 {
    let h = at_prm.d / 2u;
    return select(c - h, c + h, c < h);
}

// Element c of q's (or k's) row at `row`, as the forward reads it (the
// backward's passes read q alone: each function reads its own buffer).
fn q_at(row: u32, c: u32) -> f32 {
    if ROT_LOAD {
        return rotated(row, c, vec2<f32>(load_q(row + c), load_q(row + partner(c))));
    }
    return load_q(row + c);
}

fn k_at(row: u32, c: u32) -> f32 {
    if ROT_LOAD {
        return rotated(row, c, vec2<f32>(load_k(row + c), load_k(row + partner(c))));
    }
    return load_k(row + c);
}

// x stored as the backward's r_fmt says (rnd_r's runtime twin).
fn rnd_back(x: f32) -> f32 {
    if at_prm.r_fmt == 0u {
        return x;
    }
    return round_fmt(x, at_prm.r_fmt);
}

// Elements c and c + D/2 of a row of dq (or dk) rotated back, `g` their
// values as stored: the gradients of the unrotated row at `pos` (rope.wgsl's
// rope_grad, the arriving gradient stored as r_fmt says first).
fn rotated_back(g: vec2<f32>, pos: u32, c: u32) -> vec2<f32> {
    let h = at_prm.d / 2u;
    let e = pos * at_prm.d + c;
    let ca = at_prm.cos_at;
    let sa = at_prm.sin_at;
    let g1 = rnd_back(g.x);
    let g2 = rnd_back(g.y);
    return vec2<f32>(rope_grad(g1, g2, at_cs[ca + e], at_cs[sa + e + h], true, at_prm.zero),
                     rope_grad(g2, g1, at_cs[ca + e + h], at_cs[sa + e], false, at_prm.zero));
}

fn rnd_s(x: f32) -> f32 {
    if S_FMT == 0u {
        return x;
    }
    return round_fmt(x, S_FMT);
}

fn rnd_y(x: f32) -> f32 {
    if Y_FMT == 0u {
        return x;
    }
    return round_fmt(x, Y_FMT);
}

// Elements c..c+3 of the row of q, k, v or dy starting at `row`, rounded as
// their products read them; past D the row's last element (never used).
fn q4(row: u32, c: u32) -> vec4<f32> {
    let l = at_prm.d - 1u;
    return vec4<f32>(rnd_s(q_at(row, c)), rnd_s(q_at(row, min(c + 1u, l))),
                     rnd_s(q_at(row, min(c + 2u, l))), rnd_s(q_at(row, min(c + 3u, l))));
}

fn k4(row: u32, c: u32) -> vec4<f32> {
    let l = at_prm.d - 1u;
    return vec4<f32>(rnd_s(k_at(row, c)), rnd_s(k_at(row, min(c + 1u, l))),
                     rnd_s(k_at(row, min(c + 2u, l))), rnd_s(k_at(row, min(c + 3u, l))));
}

fn v4(row: u32, c: u32) -> vec4<f32> {
    let l = at_prm.d - 1u;
    return vec4<f32>(rnd_y(load_v(row + c)), rnd_y(load_v(row + min(c + 1u, l))),
                     rnd_y(load_v(row + min(c + 2u, l))), rnd_y(load_v(row + min(c + 3u, l))));
}

fn dy4(row: u32, c: u32) -> vec4<f32> {
    let l = at_prm.d - 1u;
    return vec4<f32>(rnd_y(at_dy[row + c]), rnd_y(at_dy[row + min(c + 1u, l)]),
                     rnd_y(at_dy[row + min(c + 2u, l)]), rnd_y(at_dy[row + min(c + 3u, l)]));
}

// Terms p..p+3 of four chains along D (four keys: one row x against rows
// y0..y3), in order, those past D selected away: the device's fma with
// `fast` (exact products), else fma_c.
fn chains4(x: vec4<f32>, y0: vec4<f32>, y1: vec4<f32>, y2: vec4<f32>, y3: vec4<f32>, acc: vec4<f32>, p: u32,
           fast: bool) -> vec4<f32> {
    let d = at_prm.d;
    var a = term4(x.x, vec4<f32>(y0.x, y1.x, y2.x, y3.x), acc, fast);
    a = select(a, term4(x.y, vec4<f32>(y0.y, y1.y, y2.y, y3.y), a, fast), p + 1u < d);
    a = select(a, term4(x.z, vec4<f32>(y0.z, y1.z, y2.z, y3.z), a, fast), p + 2u < d);
    a = select(a, term4(x.w, vec4<f32>(y0.w, y1.w, y2.w, y3.w), a, fast), p + 3u < d);
    return a;
}

// One term x * y of four chains (four output columns, or four keys).
fn term4(x: f32, y: vec4<f32>, acc: vec4<f32>, fast: bool) -> vec4<f32> {
    if fast {
        return fma(vec4<f32>(x), y, acc);
    }
    return fma4_c(x, y, acc);
}

// The operands a guarded chain reads (exact.wgsl): the left factors (x) and
// the right ones (w) since the last `span_reset`.
var<private> span_x: Span;
var<private> span_w: Span;

fn span_reset() {
    span_x = no_span();
    span_w = no_span();
}

fn span_note(x: vec4<f32>, w: vec4<f32>) {
    span_x = span_add(span_x, x);
    span_w = span_add(span_w, w);
}

// Whether a guarded chain must run again with fma_c: some product it formed
// may not have been exact. A loop no lane enters costs nothing, where a
// branch's both sides may run, so the reruns are loops from `select(n, 0,
// redo)`.
fn span_redo() -> bool {
    return !exact_products(span_exponents(span_x), span_exponents(span_w));
}

// Where the rows of keys j..j+3 start, `stride` apart from `base`; those
// past `live` repeat the last live key (their chains are never stored).
fn key_rows(base: u32, stride: u32, j: u32, live: u32) -> vec4<u32> {
    let l = live - 1u;
    return base + vec4<u32>(j, min(j + 1u, l), min(j + 2u, l), min(j + 3u, l)) * stride;
}

// Terms p..p+3 of the four keys' chains, the operands noted where `note`
// (the first run of a guarded product).
fn keys_step(x: vec4<f32>, y0: vec4<f32>, y1: vec4<f32>, y2: vec4<f32>, y3: vec4<f32>, acc: vec4<f32>, p: u32,
             note: bool, fast: bool) -> vec4<f32> {
    if note {
        span_note(x, y0);
        span_note(x, y1);
        span_note(x, y2);
        span_note(x, y3);
    }
    return chains4(x, y0, y1, y2, y3, acc, p, fast);
}

// The scores x_ij of keys j..j+3 (key_rows) from q's row at `qa` and the
// head's k (`kp`: qk_place) (S_FMT); `first`: the first run (the device's
// fma where exact, the operands noted).
fn scores4(qa: u32, kp: vec2<u32>, j: u32, live: u32, first: bool) -> vec4<f32> {
    let d = at_prm.d;
    let kb = key_rows(kp.x, kp.y, j, live);
    var acc = vec4<f32>(0.0);
    for (var p = 0u; p < d; p += 4u) {
        acc = keys_step(q4(qa, p), k4(kb.x, p), k4(kb.y, p), k4(kb.z, p), k4(kb.w, p), acc, p, S_GUARD && first,
                        first && S_FMT != 0u);
    }
    return vec4<f32>(rnd_s(acc.x), rnd_s(acc.y), rnd_s(acc.z), rnd_s(acc.w));
}

// dp_ij of keys j..j+3 (key_rows) from dy's row at `ga` and the head's v
// (`v`: tok_place) (Y_FMT), then stored as p is.
fn grads_p4(ga: u32, v: vec2<u32>, j: u32, live: u32, first: bool) -> vec4<f32> {
    let vb = key_rows(v.x, v.y, j, live);
    var acc = vec4<f32>(0.0);
    for (var p = 0u; p < at_prm.d; p += 4u) {
        acc = keys_step(dy4(ga, p), v4(vb.x, p), v4(vb.y, p), v4(vb.z, p), v4(vb.w, p), acc, p, Y_GUARD && first,
                        first && Y_FMT != 0u);
    }
    let r = vec4<f32>(rnd_y(acc.x), rnd_y(acc.y), rnd_y(acc.z), rnd_y(acc.w));
    return vec4<f32>(stored_rounded(r.x), stored_rounded(r.y), stored_rounded(r.z), stored_rounded(r.w));
}

// softmax_rows' v_j (reduce.wgsl sm_value).
fn at_scaled(x: f32) -> f32 {
    let scale = bitcast<f32>(at_prm.scale);
    if scale != 1.0 {
        return x * scale;
    }
    return x;
}

// p_j as the products read it: stored in P_FMT's 16 bits where it is set.
fn at_stored(p: f32) -> f32 {
    if P_FMT == 0u {
        return p;
    }
    return bitcast<f32>(widen_bits(half_bits(p, P_FMT), P_FMT));
}

// dp_j rounded to P_FMT where it is set (the composition's Round).
fn stored_rounded(x: f32) -> f32 {
    if P_FMT == 0u {
        return x;
    }
    return round_fmt(x, P_FMT);
}

// softmax_rows_backward's dx before the scale: y (g - dot).
fn ds_unscaled(y: f32, g: f32, dot: f32) -> f32 {
    return y * (g - dot);
}

// The rows of v (and of y, dy, dv) of head b: the first's start and the
// distance between them.
fn tok_place(b: u32) -> vec2<u32> {
    let t = at_prm.t;
    let d = at_prm.d;
    let h = at_prm.tokens;
    if h == 0u {
        return vec2<u32>(b * t * d, d);
    }
    return vec2<u32>((b / h) * t * h * d + (b % h) * d, h * d);
}

// The rows of q and k of head b as the forward reads them, as tok_place:
// token-major with RoPE, else head-major.
fn qk_place(b: u32) -> vec2<u32> {
    if ROT_LOAD {
        return tok_place(b);
    }
    return vec2<u32>(b * at_prm.t * at_prm.d, at_prm.d);
}

// The scores of keys j0..live-1 into at_p from `sr` (scores4); a rerun
// starts at `live` where it is not needed.
fn put_scores(qa: u32, kp: vec2<u32>, sr: u32, j0: u32, live: u32, first: bool) {
    for (var j = j0; j < live; j += 4u) {
        let x = scores4(qa, kp, j, live, first);
        for (var u = 0u; u < 4u && j + u < live; u++) {
            at_p[sr + j + u] = x[u];
        }
    }
}

// dp of keys j0..live-1 into ar_ds from `sr` (grads_p4), as put_scores.
fn put_grads_p(ga: u32, v: vec2<u32>, sr: u32, j0: u32, live: u32, first: bool) {
    for (var j = j0; j < live; j += 4u) {
        let x = grads_p4(ga, v, j, live, first);
        for (var u = 0u; u < 4u && j + u < live; u++) {
            ar_ds[sr + j + u] = x[u];
        }
    }
}

// Query i's p_j, j <= i, into at_p from `sr` (as the products read them),
// from q's row at `qa` and head's k (`kp`: qk_place); returns the softmax's
// sum.
fn probs_row(qa: u32, kp: vec2<u32>, sr: u32, live: u32) -> f32 {
    span_reset();
    put_scores(qa, kp, sr, 0u, live, true);
    if S_GUARD {
        put_scores(qa, kp, sr, select(live, 0u, span_redo()), live, false);
    }
    var m = at_scaled(at_p[sr]);
    for (var j = 1u; j < live; j++) {
        m = maximum_c(m, at_scaled(at_p[sr + j]));
    }
    var s = -0.0;
    for (var j = 0u; j < live; j++) {
        let e = m_exp(at_scaled(at_p[sr + j]) - m);
        at_p[sr + j] = e;
        s = s + e;
    }
    for (var j = 0u; j < live; j++) {
        at_p[sr + j] = at_stored(m_div(at_p[sr + j], s));
    }
    return s;
}

// grid: (ceil(T / 64), heads, 1); 64 invocations a workgroup, one query row each.
@compute @workgroup_size(64)
fn attention(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let i = wg.x * 64u + lane;
    if i < at_prm.t {
        forward_row(at_prm.head0 + wg.y, i);
    }
}

// The same, each invocation first writing its row's words of q, k and v
// (keep_rows; q, k and v float32 values). grid: as attention's.
@compute @workgroup_size(64)
fn attention_keeping(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let t = at_prm.t;
    let i = wg.x * 64u + lane;
    if i < t {
        let b = at_prm.head0 + wg.y;
        let v = tok_place(b);
        let qk = qk_place(b);
        keep_rows(qk.x + i * qk.y, (b * t + i) * at_prm.d, v.x + i * v.y);
        forward_row(b, i);
    }
}

// Query row i of head b: its probabilities into at_p, then y = p v.
fn forward_row(b: u32, i: u32) {
    let t = at_prm.t;
    let d = at_prm.d;
    let sr = (b * t + i) * t;
    let live = i + 1u;
    let qk = qk_place(b);
    probs_row(qk.x + i * qk.y, qk, sr, live);
    let v = tok_place(b);
    // y = p v
    for (var c = 0u; c < d; c += 4u) {
        var acc = vec4<f32>(0.0);
        span_reset();
        for (var j = 0u; j < live; j++) {
            let x = rnd_y(at_p[sr + j]);
            let y = v4(v.x + j * v.y, c);
            if Y_GUARD {
                span_note(vec4<f32>(x), y);
            }
            acc = term4(x, y, acc, Y_FMT != 0u);
        }
        if Y_GUARD {
            let redo = span_redo();
            acc = select(acc, vec4<f32>(0.0), redo);
            for (var j = select(live, 0u, redo); j < live; j++) {
                acc = term4(rnd_y(at_p[sr + j]), v4(v.x + j * v.y, c), acc, false);
            }
        }
        for (var u = 0u; u < 4u && c + u < d; u++) {
            at_y[v.x + i * v.y + c + u] = rnd_y(acc[u]);
        }
    }
}

// Row i's words of q and k as the forward reads them (from `src`, into the
// head-major row at `dst`; float32 values where keep is 0) and of v (from
// `vr`, where keep_v is set): float32 values packed as pack.wgsl packs them.
fn keep_rows(src: u32, dst: u32, vr: u32) {
    let f = at_prm.keep;
    let fv = at_prm.keep_v;
    let kw = at_prm.kw;
    for (var e = 0u; e < at_prm.d; e += 2u) {
        let a = dst + e;
        let q = vec2<f32>(q_at(src, e), q_at(src, e + 1u));
        let k = vec2<f32>(k_at(src, e), k_at(src, e + 1u));
        if f == 0u {
            at_wqk[a] = bitcast<u32>(q.x);
            at_wqk[a + 1u] = bitcast<u32>(q.y);
            at_wqk[kw + a] = bitcast<u32>(k.x);
            at_wqk[kw + a + 1u] = bitcast<u32>(k.y);
        } else {
            at_wqk[a / 2u] = half_bits(q.x, f) | (half_bits(q.y, f) << 16u);
            at_wqk[kw + a / 2u] = half_bits(k.x, f) | (half_bits(k.y, f) << 16u);
        }
        if fv != 0u {
            let b = vr + e;
            at_wv[b / 2u] = half_bits(load_v(b), fv) | (half_bits(load_v(b + 1u), fv) << 16u);
        }
    }
}

// The backward's row pass: p, dp, ds and dq of query row i.
// grid: (ceil(T / 64), heads, 1); 64 invocations a workgroup, one query row each.
@compute @workgroup_size(64)
fn attention_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let t = at_prm.t;
    let d = at_prm.d;
    let i = wg.x * 64u + lane;
    if i >= t {
        return;
    }
    let b = at_prm.head0 + wg.y;
    let sr = (b * t + i) * t;
    let live = i + 1u;
    let k0 = b * t * d;
    let s = probs_row((b * t + i) * d, vec2<u32>(k0, d), sr, live);
    // dp of the live keys, into ds's row
    let v = tok_place(b);
    let ga = v.x + i * v.y;
    span_reset();
    put_grads_p(ga, v, sr, 0u, live, true);
    if Y_GUARD {
        put_grads_p(ga, v, sr, select(live, 0u, span_redo()), live, false);
    }
    // the softmax backward: the dot over every key, the masked ones' dp +0
    // and p div(+0, s); then ds of the live keys
    var dot = -0.0;
    for (var j = 0u; j < live; j++) {
        dot = fma_c(ar_ds[sr + j], at_p[sr + j], dot);
    }
    let masked = at_stored(m_div(0.0, s));
    for (var j = live; j < t; j++) {
        dot = fma_c(0.0, masked, dot);
    }
    let scale = bitcast<f32>(at_prm.scale);
    for (var j = 0u; j < live; j++) {
        var ds = ds_unscaled(at_p[sr + j], ar_ds[sr + j], dot);
        if scale != 1.0 {
            ds = ds * scale;
        }
        ar_ds[sr + j] = ds;
    }
    // dq = ds k, token-major with RoPE
    let dqr = select((b * t + i) * d, ga, at_prm.rot_back == 1u);
    for (var c = 0u; c < d; c += 4u) {
        var acc = vec4<f32>(0.0);
        span_reset();
        for (var j = 0u; j < live; j++) {
            let x = rnd_s(ar_ds[sr + j]);
            let y = k4(k0 + j * d, c);
            if S_GUARD {
                span_note(vec4<f32>(x), y);
            }
            acc = term4(x, y, acc, S_FMT != 0u);
        }
        if S_GUARD {
            let redo = span_redo();
            acc = select(acc, vec4<f32>(0.0), redo);
            for (var j = select(live, 0u, redo); j < live; j++) {
                acc = term4(rnd_s(ar_ds[sr + j]), k4(k0 + j * d, c), acc, false);
            }
        }
        for (var u = 0u; u < 4u && c + u < d; u++) {
            ar_dq[dqr + c + u] = rnd_s(acc[u]);
        }
    }
    if at_prm.rot_back == 1u {
        let h = d / 2u;
        for (var c = 0u; c < h; c++) {
            let g = rotated_back(vec2<f32>(ar_dq[dqr + c], ar_dq[dqr + c + h]), i, c);
            ar_dq[dqr + c] = g.x;
            ar_dq[dqr + c + h] = g.y;
        }
    }
}

// The backward's column pass: dk and dv of key row j, from the row pass's p
// and ds (column j: queries i >= j).
// grid: (ceil(T / 64), heads, 1); 64 invocations a workgroup, one key row each.
@compute @workgroup_size(64)
fn attention_columns(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let t = at_prm.t;
    let d = at_prm.d;
    let j = wg.x * 64u + lane;
    if j >= t {
        return;
    }
    let b = at_prm.head0 + wg.y;
    let q0 = b * t * d;
    let col = b * t * t + j; // (i, j) at col + i * t
    let v = tok_place(b);
    let dkr = select((b * t + j) * d, v.x + j * v.y, at_prm.rot_back == 1u); // token-major with RoPE
    for (var c = 0u; c < d; c += 4u) {
        // dk = dsᵀ q
        var acc = vec4<f32>(0.0);
        span_reset();
        for (var i = j; i < t; i++) {
            let x = rnd_s(ac_ds[col + i * t]);
            let y = q4(q0 + i * d, c);
            if S_GUARD {
                span_note(vec4<f32>(x), y);
            }
            acc = term4(x, y, acc, S_FMT != 0u);
        }
        if S_GUARD {
            let redo = span_redo();
            acc = select(acc, vec4<f32>(0.0), redo);
            for (var i = select(t, j, redo); i < t; i++) {
                acc = term4(rnd_s(ac_ds[col + i * t]), q4(q0 + i * d, c), acc, false);
            }
        }
        for (var u = 0u; u < 4u && c + u < d; u++) {
            ac_dk[dkr + c + u] = rnd_s(acc[u]);
        }
        // dv = pᵀ dy
        acc = vec4<f32>(0.0);
        span_reset();
        for (var i = j; i < t; i++) {
            let x = rnd_y(ac_p[col + i * t]);
            let y = dy4(v.x + i * v.y, c);
            if Y_GUARD {
                span_note(vec4<f32>(x), y);
            }
            acc = term4(x, y, acc, Y_FMT != 0u);
        }
        if Y_GUARD {
            let redo = span_redo();
            acc = select(acc, vec4<f32>(0.0), redo);
            for (var i = select(t, j, redo); i < t; i++) {
                acc = term4(rnd_y(ac_p[col + i * t]), dy4(v.x + i * v.y, c), acc, false);
            }
        }
        for (var u = 0u; u < 4u && c + u < d; u++) {
            ac_dv[v.x + j * v.y + c + u] = rnd_y(acc[u]);
        }
    }
    if at_prm.rot_back == 1u {
        let h = d / 2u;
        for (var c = 0u; c < h; c++) {
            let g = rotated_back(vec2<f32>(ac_dk[dkr + c], ac_dk[dkr + c + h]), j, c);
            ac_dk[dkr + c] = g.x;
            ac_dk[dkr + c + h] = g.y;
        }
    }
}
