// fused.wgsl — RMSNorm, SwiGLU, RoPE and softmax cross-entropy, each direction
// the CPU reference's (fused/cpu.rs) operations in the same order (needs mathlib).
// The contract is in fused/mod.rs: every formula is that of the composition of
// single ops the primitive replaces, so every product is rounded on its own.
// Row kernels give one invocation a whole row (its folds serial, ascending);
// elementwise kernels one element. 1-D grids: i = grid_index(wg, groups, lane).
//
// Two guards against what a WGSL compiler may do to float code:
// * `sep(p, zero)` (math.wgsl) passes a result on through its bits ORed with
//   `zero`, a params field the host sets to 0: no compiler can see the
//   operation behind it, so none can contract a product with the add it feeds
//   into one fma (legal in WGSL, and one rounding instead of the
//   composition's two), nor regroup a chain of products or sums through it
//   ((x·r)·w into x·(r·w)): each is rounded as the composition rounds it;
// * `+ 0` adds `bitcast<f32>(zero)`, a runtime +0, never a literal: `x + 0.0`
//   may be folded to `x`, but it turns −0 into +0, which the composition does.

// ---- RMSNorm: x: (rows, d), w: (d) -> y: (rows, d), rstd: (rows) ----
// ss = Σ x·x (ascending from -0), r = div(1, sqrt(div(ss, d) + eps)), y = (x·r)·w.

struct NormParams {
    rows: u32,
    d: u32,
    d_f: u32, // f32(d) as the host rounds it, bits
    eps: u32, // f32 bits (narrowed once on the host)
    zero: u32,
}

@group(0) @binding(0) var<storage, read> rn_prm: NormParams;
@group(0) @binding(1) var<storage, read> rn_x: array<f32>;
@group(0) @binding(2) var<storage, read> rn_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> rn_y: array<f32>;
@group(0) @binding(4) var<storage, read_write> rn_rstd: array<f32>;

@compute @workgroup_size(64)
fn rms_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
            @builtin(local_invocation_index) lane: u32) {
    let row = grid_index(wg, groups, lane);
    if row >= rn_prm.rows {
        return;
    }
    let d = rn_prm.d;
    let z = rn_prm.zero;
    let base = row * d;
    var ss = -0.0;
    for (var j = 0u; j < d; j++) {
        let v = rn_x[base + j];
        ss = ss + sep(v * v, z);
    }
    let r = m_div(1.0, m_sqrt(m_div(ss, bitcast<f32>(rn_prm.d_f)) + bitcast<f32>(rn_prm.eps)));
    rn_rstd[row] = r;
    for (var j = 0u; j < d; j++) {
        rn_y[base + j] = sep(rn_x[base + j] * r, z) * rn_w[j];
    }
}

// ---- RMSNorm backward, per row: x, g, e: (rows, d), w: (d), rstd: (rows) -> dx: (rows, d) ----
// gw = g·w, gr = Σ gw·x, gs = div((((gr·r)·r)·r)·(-0.5), d); dx1 = gw·r,
// dx2 = (gs·x)·2; dx = (e + dx1) + dx2 with the earlier gradient e, else dx1 + dx2.
// The workgroups after the first `row_groups` fold the weight's gradient
// (below), one column an invocation over every row: both in one dispatch
// where the rows fit one pass. The parameters are a uniform buffer, so that
// the eight buffers are all storage ones (the least WebGPU promises).

struct NormBackParams {
    rows: u32,
    d: u32,
    d_f: u32,       // f32(d) as the host rounds it, bits
    earlier: u32,   // 1: add into rb_e (else rb_e is any buffer, unread)
    zero: u32,
    row_groups: u32, // workgroups of rows; the rest fold dw's columns
    levels: u32,    // dw's folds, as DwParams'
    earlier_dw: u32, // 1: add into rb_dw_e
    spans: array<vec4<u32>, 2>, // DwParams' spans, spans[l / 4][l % 4]
}

@group(0) @binding(0) var<uniform> rb_prm: NormBackParams;
@group(0) @binding(1) var<storage, read> rb_x: array<f32>;
@group(0) @binding(2) var<storage, read> rb_w: array<f32>;
@group(0) @binding(3) var<storage, read> rb_rstd: array<f32>;
@group(0) @binding(4) var<storage, read> rb_g: array<f32>;
@group(0) @binding(5) var<storage, read> rb_e: array<f32>;
@group(0) @binding(6) var<storage, read_write> rb_dx: array<f32>;
@group(0) @binding(7) var<storage, read_write> rb_dw: array<f32>;
@group(0) @binding(8) var<storage, read> rb_dw_e: array<f32>;

// dw's column j = (group - row_groups)·64 + lane over every row, as the
// passes of rms_norm_backward_dw fold it.
fn rms_dw_column(group: u32, lane: u32) {
    let j = (group - rb_prm.row_groups) * 64u + lane;
    let d = rb_prm.d;
    if j >= d {
        return;
    }
    let s = rb_prm.spans;
    let spans = array<u32, 6>(s[0].x, s[0].y, s[0].z, s[0].w, s[1].x, s[1].y);
    var acc: array<f32, 6>;
    for (var l = 0u; l < 6u; l++) {
        acc[l] = -0.0;
    }
    for (var row = 0u; row < rb_prm.rows; row++) {
        let at = row * d + j;
        rms_dw_fold(&acc, rb_x[at], rb_rstd[row], rb_g[at], rb_prm.zero, row, rb_prm.levels, spans);
    }
    if rb_prm.earlier_dw != 0u {
        rb_dw[j] = rb_dw_e[j] + acc[0];
    } else {
        rb_dw[j] = acc[0];
    }
}

@compute @workgroup_size(64)
fn rms_norm_backward_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                          @builtin(local_invocation_index) lane: u32) {
    let group = grid_index(wg, groups, 0u) / 64u;
    if group >= rb_prm.row_groups {
        rms_dw_column(group, lane);
        return;
    }
    let row = grid_index(wg, groups, lane);
    if row >= rb_prm.rows {
        return;
    }
    let d = rb_prm.d;
    let z = rb_prm.zero;
    let base = row * d;
    var gr = -0.0;
    for (var j = 0u; j < d; j++) {
        let gw = sep(rb_g[base + j] * rb_w[j], z);
        gr = gr + sep(gw * rb_x[base + j], z);
    }
    let r = rb_rstd[row];
    // each product its own rounding, before the constant factor: a chain of
    // products by the same r is reassociated otherwise (lavapipe does)
    let gs = m_div(sep(sep(sep(gr * r, z) * r, z) * r, z) * -0.5, bitcast<f32>(rb_prm.d_f));
    for (var j = 0u; j < d; j++) {
        let gw = sep(rb_g[base + j] * rb_w[j], z);
        // every product rounded before its sum (no fused multiply-add)
        let dx1 = sep(gw * r, z);
        let dx2 = sep(sep(gs * rb_x[base + j], z) * 2.0, z);
        if rb_prm.earlier != 0u {
            rb_dx[base + j] = sep(rb_e[base + j] + dx1, z) + dx2;
        } else {
            rb_dx[base + j] = dx1 + dx2;
        }
    }
}

// ---- RMSNorm backward, the weight's gradient: x, g: (rows, d), rstd: (rows) -> dw: (d) ----
// One invocation per column j sums g·(x·r) over the rows in order, nested like
// broadcasting's backward: acc[L-1] folds each block of spans[L-1] rows from
// -0; a finished block's sum is added into the level outside it (acc[l-1]),
// which folds blocks of spans[l-1] rows, ... up to acc[0] over every row.
// One dispatch covers rows [r0, r1): lavapipe stops a shader after 65,535
// loop iterations, so the host splits long runs into passes that carry the
// accumulators through `state` ((6, d)); the order of the additions is unchanged.
// With `earlier`, the last pass stores e[j] + the sum (e: (d), the weight's
// gradient so far: accumulation over micro-batches without an add of its own).

struct DwParams {
    rows: u32,
    d: u32,
    levels: u32, // 1 ..= 6
    r0: u32,
    r1: u32,
    zero: u32,
    earlier: u32, // 1: add dw_e
    _pad1: u32,
    spans: array<u32, 6>, // rows per fold of each level, outermost first (spans[0] = rows)
}

@group(0) @binding(0) var<storage, read> dw_prm: DwParams;
@group(0) @binding(1) var<storage, read> dw_x: array<f32>;
@group(0) @binding(2) var<storage, read> dw_rstd: array<f32>;
@group(0) @binding(3) var<storage, read> dw_g: array<f32>;
@group(0) @binding(4) var<storage, read_write> dw_state: array<f32>;
@group(0) @binding(5) var<storage, read_write> dw_out: array<f32>;
@group(0) @binding(6) var<storage, read> dw_e: array<f32>;

// Row `row`'s term g·(x·r) into the innermost level, then every level whose
// block ends at this row closed into the one outside it, innermost first.
fn rms_dw_fold(acc: ptr<function, array<f32, 6>>, x: f32, r: f32, g: f32, z: u32, row: u32, levels: u32,
               spans: array<u32, 6>) {
    let xr = sep(x * r, z);
    (*acc)[levels - 1u] = (*acc)[levels - 1u] + sep(g * xr, z);
    for (var l = levels - 1u; l >= 1u; l--) {
        if (row + 1u) % spans[l] != 0u {
            break;
        }
        (*acc)[l - 1u] = (*acc)[l - 1u] + (*acc)[l];
        (*acc)[l] = -0.0;
    }
}

@compute @workgroup_size(64)
fn rms_norm_backward_dw(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                        @builtin(local_invocation_index) lane: u32) {
    let j = grid_index(wg, groups, lane);
    let d = dw_prm.d;
    if j >= d {
        return;
    }
    let z = dw_prm.zero;
    let levels = dw_prm.levels;
    var acc: array<f32, 6>;
    for (var l = 0u; l < 6u; l++) {
        if dw_prm.r0 == 0u {
            acc[l] = -0.0;
        } else {
            acc[l] = dw_state[l * d + j];
        }
    }
    for (var row = dw_prm.r0; row < dw_prm.r1; row++) {
        let at = row * d + j;
        rms_dw_fold(&acc, dw_x[at], dw_rstd[row], dw_g[at], z, row, levels, dw_prm.spans);
    }
    if dw_prm.r1 == dw_prm.rows {
        if dw_prm.earlier != 0u {
            dw_out[j] = dw_e[j] + acc[0];
        } else {
            dw_out[j] = acc[0];
        }
    } else {
        for (var l = 0u; l < 6u; l++) {
            dw_state[l * d + j] = acc[l];
        }
    }
}

// ---- SwiGLU: gate, up: (n) -> y: (n) ----
// s = σ(gate) = div(1, 1 + exp(-0 - gate)); y = (gate·s)·up.
// With keep (a FMT_* code), gate and up also as 16-bit words (pack.wgsl's
// layout) in w_gate, w_up: the copies autograd keeps for the backward, each
// word written by the invocation of its first value.

struct EltParams {
    n: u32,
    zero: u32,
    keep: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> sw_prm: EltParams;
@group(0) @binding(1) var<storage, read> sw_gate: array<f32>;
@group(0) @binding(2) var<storage, read> sw_up: array<f32>;
@group(0) @binding(3) var<storage, read_write> sw_y: array<f32>;
// Without keep, y stands in for both, unwritten.
@group(0) @binding(4) var<storage, read_write> sw_w_gate: array<u32>;
@group(0) @binding(5) var<storage, read_write> sw_w_up: array<u32>;

@compute @workgroup_size(64)
fn swiglu(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
          @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    let n = sw_prm.n;
    if i >= n {
        return;
    }
    let x = sw_gate[i];
    sw_y[i] = swiglu_of(x, sw_up[i], sw_prm.zero);
    let keep = sw_prm.keep;
    if keep != 0u && (i & 1u) == 0u {
        var wg_bits = half_bits(x, keep);
        var wu_bits = half_bits(sw_up[i], keep);
        if i + 1u < n {
            wg_bits = wg_bits | (half_bits(sw_gate[i + 1u], keep) << 16u);
            wu_bits = wu_bits | (half_bits(sw_up[i + 1u], keep) << 16u);
        }
        sw_w_gate[i / 2u] = wg_bits;
        sw_w_up[i / 2u] = wu_bits;
    }
}

// ---- SwiGLU backward: gate, up, g: (n) -> d_gate, d_up: (n) ----
// s = σ(gate); d_gate = (g·up)·(s·fma(gate, 1 - s, 1)); d_up = g·(gate·s).
// gate and up are read as bits: float32 values, or with gate_half / up_half
// (the FMT_* code of an operand kept in 16-bit storage) words of two values
// (value i in the low half of word i / 2 for even i), widened exactly.

struct SwigluBackParams {
    n: u32,
    zero: u32,
    gate_half: u32,
    up_half: u32,
}

@group(0) @binding(0) var<storage, read> sb_prm: SwigluBackParams;
@group(0) @binding(1) var<storage, read> sb_gate: array<u32>;
@group(0) @binding(2) var<storage, read> sb_up: array<u32>;
@group(0) @binding(3) var<storage, read> sb_g: array<f32>;
@group(0) @binding(4) var<storage, read_write> sb_dgate: array<f32>;
@group(0) @binding(5) var<storage, read_write> sb_dup: array<f32>;

@compute @workgroup_size(64)
fn swiglu_backward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                   @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    if i >= sb_prm.n {
        return;
    }
    var x = bitcast<f32>(sb_gate[i]);
    if sb_prm.gate_half != 0u {
        x = half_value(sb_gate[i / 2u], i, sb_prm.gate_half);
    }
    var up = bitcast<f32>(sb_up[i]);
    if sb_prm.up_half != 0u {
        up = half_value(sb_up[i / 2u], i, sb_prm.up_half);
    }
    let g = sb_g[i];
    let s = m_sigmoid(x);
    let z = sb_prm.zero;
    sb_dgate[i] = sep(g * up, z) * sep(s * fma_c(x, 1.0 - s, 1.0), z);
    sb_dup[i] = g * sep(x * s, z);
}

// ---- RoPE: x: (B, t, heads, d), cos, sin: (t, d) -> y: (B, heads, t, d) ----
// h = d/2; j < h: y = x_j·c_j + (-0 - x_{j+h})·s_j; j >= h: y = x_j·c_j + x_{j-h}·s_j.
// One invocation per output element; the permute to head-major rows is the
// index arithmetic (with one head, row i at position i mod t both ways).

struct RopeParams {
    n: u32, // B * t * heads * d
    t: u32,
    d: u32,
    heads: u32,
    zero: u32,
}

// (input row, position) of head-major output row o = (b·heads + head)·t + p:
// token-major row (b·t + p)·heads + head.
fn rope_from_tokens(o: u32, t: u32, heads: u32) -> vec2<u32> {
    let bh = o / t;
    let p = o % t;
    return vec2<u32>((bh / heads * t + p) * heads + bh % heads, p);
}

// (input row, position) of token-major output row o = (b·t + p)·heads + head:
// head-major row (b·heads + head)·t + p.
fn rope_from_heads(o: u32, t: u32, heads: u32) -> vec2<u32> {
    let bp = o / heads;
    let p = bp % t;
    return vec2<u32>((bp / t * heads + o % heads) * t + p, p);
}

@group(0) @binding(0) var<storage, read> ro_prm: RopeParams;
@group(0) @binding(1) var<storage, read> ro_x: array<f32>;
@group(0) @binding(2) var<storage, read> ro_cos: array<f32>;
@group(0) @binding(3) var<storage, read> ro_sin: array<f32>;
@group(0) @binding(4) var<storage, read_write> ro_y: array<f32>;

@compute @workgroup_size(64)
fn rope(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
        @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    if i >= ro_prm.n {
        return;
    }
    let d = ro_prm.d;
    let h = d / 2u;
    let j = i % d;
    let src = rope_from_tokens(i / d, ro_prm.t, ro_prm.heads);
    let x = src.x * d + j; // this element's input
    let p = src.y * d + j; // its entry of the tables
    let partner = ro_x[select(x - h, x + h, j < h)];
    ro_y[i] = rope_value(ro_x[x], partner, ro_cos[p], ro_sin[p], j < h, ro_prm.zero);
}

// ---- RoPE of two tensors at once (attention's q and k): x0, x1: (B, t,
// heads, d) -> y0, y1: (B, heads, t, d), each as `rope` rotates it; element
// i < n of the grid is x0's, i - n x1's. ----

@group(0) @binding(0) var<storage, read> rp_prm: RopeParams;
@group(0) @binding(1) var<storage, read> rp_x0: array<f32>;
@group(0) @binding(2) var<storage, read> rp_x1: array<f32>;
@group(0) @binding(3) var<storage, read> rp_cos: array<f32>;
@group(0) @binding(4) var<storage, read> rp_sin: array<f32>;
@group(0) @binding(5) var<storage, read_write> rp_y0: array<f32>;
@group(0) @binding(6) var<storage, read_write> rp_y1: array<f32>;

fn rp_load(second: bool, e: u32) -> f32 {
    if second {
        return rp_x1[e];
    }
    return rp_x0[e];
}

@compute @workgroup_size(64)
fn rope_pair(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
             @builtin(local_invocation_index) lane: u32) {
    let g = grid_index(wg, groups, lane);
    let n = rp_prm.n;
    if g >= 2u * n {
        return;
    }
    let second = g >= n;
    let i = select(g, g - n, second);
    let d = rp_prm.d;
    let h = d / 2u;
    let j = i % d;
    let src = rope_from_tokens(i / d, rp_prm.t, rp_prm.heads);
    let x = src.x * d + j;
    let p = src.y * d + j;
    let partner = rp_load(second, select(x - h, x + h, j < h));
    let y = rope_value(rp_load(second, x), partner, rp_cos[p], rp_sin[p], j < h, rp_prm.zero);
    if second {
        rp_y1[i] = y;
    } else {
        rp_y0[i] = y;
    }
}

// ---- RoPE backward: g: (B, heads, t, d), cos, sin: (t, d) -> dx: (B, t, heads, d) ----
// j < h: dx = ((g_j·c_j) + 0) + g_{j+h}·s_{j+h}; j >= h: dx = ((g_j·c_j) + (-0 - g_{j-h}·s_{j-h})) + 0.

@group(0) @binding(0) var<storage, read> rg_prm: RopeParams;
@group(0) @binding(1) var<storage, read> rg_g: array<f32>;
@group(0) @binding(2) var<storage, read> rg_cos: array<f32>;
@group(0) @binding(3) var<storage, read> rg_sin: array<f32>;
@group(0) @binding(4) var<storage, read_write> rg_dx: array<f32>;

@compute @workgroup_size(64)
fn rope_backward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                 @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    if i >= rg_prm.n {
        return;
    }
    let d = rg_prm.d;
    let h = d / 2u;
    let z = rg_prm.zero;
    let j = i % d;
    let src = rope_from_heads(i / d, rg_prm.t, rg_prm.heads);
    let x = src.x * d + j;
    let p = src.y * d + j;
    let q = select(p - h, p + h, j < h); // the partner's entry of the tables
    let partner = rg_g[select(x - h, x + h, j < h)];
    rg_dx[i] = rope_grad(rg_g[x], partner, rg_cos[p], rg_sin[q], j < h, z);
}

// ---- RoPE backward of two tensors at once (attention's q and k): g0, g1:
// (B, heads, t, d) -> dx0, dx1: (B, t, heads, d), each as `rope_backward`
// has it; element i < n of the grid is g0's, i - n g1's. ----

@group(0) @binding(0) var<storage, read> rq_prm: RopeParams;
@group(0) @binding(1) var<storage, read> rq_g0: array<f32>;
@group(0) @binding(2) var<storage, read> rq_g1: array<f32>;
@group(0) @binding(3) var<storage, read> rq_cos: array<f32>;
@group(0) @binding(4) var<storage, read> rq_sin: array<f32>;
@group(0) @binding(5) var<storage, read_write> rq_dx0: array<f32>;
@group(0) @binding(6) var<storage, read_write> rq_dx1: array<f32>;

fn rq_load(second: bool, e: u32) -> f32 {
    if second {
        return rq_g1[e];
    }
    return rq_g0[e];
}

@compute @workgroup_size(64)
fn rope_backward_pair(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                      @builtin(local_invocation_index) lane: u32) {
    let gi = grid_index(wg, groups, lane);
    let n = rq_prm.n;
    if gi >= 2u * n {
        return;
    }
    let second = gi >= n;
    let i = select(gi, gi - n, second);
    let d = rq_prm.d;
    let h = d / 2u;
    let j = i % d;
    let src = rope_from_heads(i / d, rq_prm.t, rq_prm.heads);
    let x = src.x * d + j;
    let p = src.y * d + j;
    let q = select(p - h, p + h, j < h);
    let partner = rq_load(second, select(x - h, x + h, j < h));
    let dx = rope_grad(rq_load(second, x), partner, rq_cos[p], rq_sin[q], j < h, rq_prm.zero);
    if second {
        rq_dx1[i] = dx;
    } else {
        rq_dx0[i] = dx;
    }
}

// ---- cross-entropy, per row: x: (rows, v), targets: (rows) u32 -> stats: (rows, 2), row losses: (rows) ----
// m = max of the row (from x_0, then maximum_c over x_1.. ascending: never from
// a constant -inf, which a compiler assuming no infinities may fold; the same
// bits, as maximum(-inf, x_0) = x_0; v >= 1 as every row has a target),
// S = Σ exp(x - m), p = (x_t - m) - log(S).

// The *_keeping entries also write the logits as 16-bit words of FMT_* code
// `keep` (pack.wgsl's; v even, so that no word spans two rows): the copy
// autograd keeps, each row's by the invocation that folds it.

struct CeParams {
    rows: u32,
    v: u32,
    rows_f: u32, // f32(rows) as the host rounds it, bits
    zero: u32,
    keep: u32,
}

@group(0) @binding(0) var<storage, read> ce_prm: CeParams;
@group(0) @binding(1) var<storage, read> ce_x: array<f32>;
@group(0) @binding(2) var<storage, read> ce_targets: array<u32>;
@group(0) @binding(3) var<storage, read_write> ce_stats: array<f32>;
@group(0) @binding(4) var<storage, read_write> ce_rowloss: array<f32>;
@group(0) @binding(5) var<storage, read_write> ce_words: array<u32>;

// The words of the row the invocation (wg, lane) folds.
fn ce_keep_row(wg: vec3<u32>, groups: vec3<u32>, lane: u32) {
    let row = grid_index(wg, groups, lane);
    if row >= ce_prm.rows {
        return;
    }
    let f = ce_prm.keep;
    let v = ce_prm.v;
    for (var e = row * v; e < (row + 1u) * v; e += 2u) {
        ce_words[e / 2u] = half_bits(ce_x[e], f) | (half_bits(ce_x[e + 1u], f) << 16u);
    }
}

@compute @workgroup_size(64)
fn cross_entropy_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                      @builtin(local_invocation_index) lane: u32) {
    ce_row(grid_index(wg, groups, lane));
}

@compute @workgroup_size(64)
fn cross_entropy_rows_keeping(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                              @builtin(local_invocation_index) lane: u32) {
    ce_keep_row(wg, groups, lane);
    ce_row(grid_index(wg, groups, lane));
}

fn ce_row(row: u32) {
    if row >= ce_prm.rows {
        return;
    }
    let v = ce_prm.v;
    let z = ce_prm.zero;
    let base = row * v;
    var m = ce_x[base];
    for (var j = 1u; j < v; j++) {
        m = maximum_c(m, ce_x[base + j]);
    }
    var s = -0.0;
    for (var j = 0u; j < v; j++) {
        s = s + sep(m_exp(ce_x[base + j] - m), z);
    }
    ce_stats[2u * row] = m;
    ce_stats[2u * row + 1u] = s;
    ce_rowloss[row] = (ce_x[base + ce_targets[row]] - m) - m_log(s);
}

// ---- cross-entropy, the mean: row losses: (rows) -> loss: (1) ----
// One invocation folds rows [k0, k1) in order onto the running sum in loss[0]
// (-0 first); the last pass writes loss = -0 - div(Σ, rows). Long folds run
// as several passes (lavapipe's loop cap), in the same order.

struct CeSumParams {
    rows: u32,
    k0: u32,
    k1: u32,
    rows_f: u32,
}

@group(0) @binding(0) var<storage, read> cs_prm: CeSumParams;
@group(0) @binding(1) var<storage, read> cs_rowloss: array<f32>;
@group(0) @binding(2) var<storage, read_write> cs_loss: array<f32>;

@compute @workgroup_size(1)
fn cross_entropy_mean() {
    var acc = -0.0;
    if cs_prm.k0 > 0u {
        acc = cs_loss[0];
    }
    for (var k = cs_prm.k0; k < cs_prm.k1; k++) {
        acc = acc + cs_rowloss[k];
    }
    if cs_prm.k1 == cs_prm.rows {
        cs_loss[0] = -0.0 - m_div(acc, bitcast<f32>(cs_prm.rows_f));
    } else {
        cs_loss[0] = acc;
    }
}

// ---- cross-entropy backward, per row: x: (rows, v), targets, stats, G: (1) -> dx: (rows, v) ----
// a = +0 + div(-0 - G, rows), gS = div(-0 - a, S), dx_j = b_j + gS·exp(x_j - m),
// b_j = a at the target, +0 elsewhere.

struct CeBackParams {
    rows: u32,
    v: u32,
    rows_f: u32,
    zero: u32,
    x_half: u32, // FMT_* code of logits kept as 16-bit words (pack.wgsl's); 0: float32
}

@group(0) @binding(0) var<storage, read> cb_prm: CeBackParams;
@group(0) @binding(1) var<storage, read> cb_x: array<u32>;

// logit e, as a float32 value
fn cb_logit(e: u32) -> f32 {
    if cb_prm.x_half == 0u {
        return bitcast<f32>(cb_x[e]);
    }
    return half_value(cb_x[e / 2u], e, cb_prm.x_half);
}
@group(0) @binding(2) var<storage, read> cb_targets: array<u32>;
@group(0) @binding(3) var<storage, read> cb_stats: array<f32>;
@group(0) @binding(4) var<storage, read> cb_g: array<f32>;
@group(0) @binding(5) var<storage, read_write> cb_dx: array<f32>;

@compute @workgroup_size(64)
fn cross_entropy_backward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                          @builtin(local_invocation_index) lane: u32) {
    let row = grid_index(wg, groups, lane);
    if row >= cb_prm.rows {
        return;
    }
    let v = cb_prm.v;
    let z = cb_prm.zero;
    let pz = bitcast<f32>(z);
    let a = pz + m_div(-0.0 - cb_g[0], bitcast<f32>(cb_prm.rows_f));
    let m = cb_stats[2u * row];
    let gs = m_div(-0.0 - a, cb_stats[2u * row + 1u]);
    let t = cb_targets[row];
    let base = row * v;
    for (var j = 0u; j < v; j++) {
        let b = select(pz, a, j == t);
        cb_dx[base + j] = b + sep(gs * m_exp(cb_logit(base + j) - m), z);
    }
}

// ---------------------------------------------------------------------------
// The hardware variant (backend/gpu/variant.rs) of the row kernels: the same
// contract and bits, a workgroup per block of 64 rows. Lane l owns row
// row0 + l and runs exactly its fold above (ascending, from -0), but from
// workgroup memory: the block's rows are staged FW columns at a time with
// coalesced loads (consecutive lanes, consecutive columns of a row), each
// staged value already the fold's term, computed by the lane that loads it.
// What follows a fold is elementwise given the row's statistics (kept in
// workgroup memory), so consecutive lanes write consecutive elements.
// grid: grid1d(rows); 64 invocations per workgroup (cross_entropy_mean: one
// workgroup; cross_entropy_backward_elems: grid1d(rows * v)).

const FW: u32 = 16u;     // columns staged per step
const FPITCH: u32 = 17u; // a staged row's pitch (FW + 1: lanes folding different rows hit different banks)

var<workgroup> f_tile: array<f32, 1088>; // (64 rows, FW columns), pitch FPITCH
var<workgroup> f_row: array<f32, 64>;    // a statistic per row of the block
var<workgroup> f_row2: array<f32, 64>;

// grid: grid1d(rows); lane l: row row0 + l; y: (rows, d) elementwise by the block.
@compute @workgroup_size(64)
fn rms_norm_staged(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                   @builtin(local_invocation_index) lane: u32) {
    let row0 = grid_index(wg, groups, 0u); // uniform: loops with barriers depend on it only
    let rows = rn_prm.rows;
    let d = rn_prm.d;
    let z = rn_prm.zero;
    let row = row0 + lane;
    var ss = -0.0;
    for (var c0 = 0u; c0 < d; c0 += FW) {
        workgroupBarrier();
        for (var q = 0u; q < FW; q++) {
            let e = lane + 64u * q;
            let r = e / FW;
            let j = c0 + e % FW;
            if row0 + r < rows && j < d {
                let v = rn_x[(row0 + r) * d + j];
                f_tile[r * FPITCH + e % FW] = sep(v * v, z);
            }
        }
        workgroupBarrier();
        if row < rows {
            let w = min(FW, d - c0);
            for (var q = 0u; q < w; q++) {
                ss = ss + f_tile[lane * FPITCH + q];
            }
        }
    }
    let r = m_div(1.0, m_sqrt(m_div(ss, bitcast<f32>(rn_prm.d_f)) + bitcast<f32>(rn_prm.eps)));
    f_row[lane] = r;
    if row < rows {
        rn_rstd[row] = r;
    }
    workgroupBarrier();
    let end = min(rows - row0, 64u) * d;
    for (var e = lane; e < end; e += 64u) {
        let at = row0 * d + e;
        rn_y[at] = sep(rn_x[at] * f_row[e / d], z) * rn_w[e % d];
    }
}

// grid: row_groups workgroups of 64 rows, then dw's; lane l folds gr of row row0 + l;
// dx: (rows, d) elementwise by the block.
@compute @workgroup_size(64)
fn rms_norm_backward_rows_staged(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                                 @builtin(local_invocation_index) lane: u32) {
    let row0 = grid_index(wg, groups, 0u);
    if row0 / 64u >= rb_prm.row_groups {
        rms_dw_column(row0 / 64u, lane);
        return;
    }
    let rows = rb_prm.rows;
    let d = rb_prm.d;
    let z = rb_prm.zero;
    let row = row0 + lane;
    var gr = -0.0;
    for (var c0 = 0u; c0 < d; c0 += FW) {
        workgroupBarrier();
        for (var q = 0u; q < FW; q++) {
            let e = lane + 64u * q;
            let r = e / FW;
            let j = c0 + e % FW;
            if row0 + r < rows && j < d {
                let at = (row0 + r) * d + j;
                let gw = sep(rb_g[at] * rb_w[j], z);
                f_tile[r * FPITCH + e % FW] = sep(gw * rb_x[at], z);
            }
        }
        workgroupBarrier();
        if row < rows {
            let w = min(FW, d - c0);
            for (var q = 0u; q < w; q++) {
                gr = gr + f_tile[lane * FPITCH + q];
            }
        }
    }
    if row < rows {
        let r = rb_rstd[row];
        f_row[lane] = r;
        f_row2[lane] = m_div(sep(sep(sep(gr * r, z) * r, z) * r, z) * -0.5, bitcast<f32>(rb_prm.d_f));
    }
    workgroupBarrier();
    let end = min(rows - row0, 64u) * d;
    for (var e = lane; e < end; e += 64u) {
        let at = row0 * d + e;
        let r = f_row[e / d];
        let gs = f_row2[e / d];
        let gw = sep(rb_g[at] * rb_w[e % d], z);
        let dx1 = sep(gw * r, z);
        let dx2 = sep(sep(gs * rb_x[at], z) * 2.0, z);
        if rb_prm.earlier != 0u {
            rb_dx[at] = sep(rb_e[at] + dx1, z) + dx2;
        } else {
            rb_dx[at] = dx1 + dx2;
        }
    }
}

// grid: grid1d(rows); lane l folds row row0 + l's max, then its sum.
@compute @workgroup_size(64)
fn cross_entropy_rows_staged(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                             @builtin(local_invocation_index) lane: u32) {
    ce_rows_staged(wg, groups, lane);
}

@compute @workgroup_size(64)
fn cross_entropy_rows_staged_keeping(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                                     @builtin(local_invocation_index) lane: u32) {
    ce_keep_row(wg, groups, lane);
    ce_rows_staged(wg, groups, lane);
}

fn ce_rows_staged(wg: vec3<u32>, groups: vec3<u32>, lane: u32) {
    let row0 = grid_index(wg, groups, 0u);
    let rows = ce_prm.rows;
    let v = ce_prm.v; // >= 1
    let z = ce_prm.zero;
    let row = row0 + lane;
    var m = 0.0;
    for (var c0 = 0u; c0 < v; c0 += FW) {
        workgroupBarrier();
        for (var q = 0u; q < FW; q++) {
            let e = lane + 64u * q;
            let r = e / FW;
            let j = c0 + e % FW;
            if row0 + r < rows && j < v {
                f_tile[r * FPITCH + e % FW] = ce_x[(row0 + r) * v + j];
            }
        }
        workgroupBarrier();
        if row < rows {
            let w = min(FW, v - c0);
            for (var q = 0u; q < w; q++) {
                let x = f_tile[lane * FPITCH + q];
                if c0 + q == 0u {
                    m = x;
                } else {
                    m = maximum_c(m, x);
                }
            }
        }
    }
    f_row[lane] = m;
    var s = -0.0;
    for (var c0 = 0u; c0 < v; c0 += FW) {
        workgroupBarrier();
        for (var q = 0u; q < FW; q++) {
            let e = lane + 64u * q;
            let r = e / FW;
            let j = c0 + e % FW;
            if row0 + r < rows && j < v {
                f_tile[r * FPITCH + e % FW] = sep(m_exp(ce_x[(row0 + r) * v + j] - f_row[r]), z);
            }
        }
        workgroupBarrier();
        if row < rows {
            let w = min(FW, v - c0);
            for (var q = 0u; q < w; q++) {
                s = s + f_tile[lane * FPITCH + q];
            }
        }
    }
    if row < rows {
        ce_stats[2u * row] = m;
        ce_stats[2u * row + 1u] = s;
        ce_rowloss[row] = (ce_x[row * v + ce_targets[row]] - m) - m_log(s);
    }
}

// grid: one workgroup of 64; the fold of cross_entropy_mean, rows [k0, k1)
// staged 64 at a time (one coalesced load per lane), lane 0 adding them in order.
@compute @workgroup_size(64)
fn cross_entropy_mean_staged(@builtin(local_invocation_index) lane: u32) {
    var acc = -0.0;
    if cs_prm.k0 > 0u {
        acc = cs_loss[0];
    }
    let k1 = cs_prm.k1;
    for (var c0 = cs_prm.k0; c0 < k1; c0 += 64u) {
        workgroupBarrier();
        if c0 + lane < k1 {
            f_row[lane] = cs_rowloss[c0 + lane];
        }
        workgroupBarrier();
        if lane == 0u {
            let w = min(64u, k1 - c0);
            for (var q = 0u; q < w; q++) {
                acc = acc + f_row[q];
            }
        }
    }
    if lane == 0u {
        if k1 == cs_prm.rows {
            cs_loss[0] = -0.0 - m_div(acc, bitcast<f32>(cs_prm.rows_f));
        } else {
            cs_loss[0] = acc;
        }
    }
}

// grid: grid1d(rows * v); one invocation per element of dx (the backward has
// no fold: each element is cross_entropy_backward's formula for its row).
@compute @workgroup_size(64)
fn cross_entropy_backward_elems(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                                @builtin(local_invocation_index) lane: u32) {
    let i = grid_index(wg, groups, lane);
    let v = cb_prm.v;
    if i >= cb_prm.rows * v {
        return;
    }
    let row = i / v;
    let j = i % v;
    let z = cb_prm.zero;
    let pz = bitcast<f32>(z);
    let a = pz + m_div(-0.0 - cb_g[0], bitcast<f32>(cb_prm.rows_f));
    let m = cb_stats[2u * row];
    let gs = m_div(-0.0 - a, cb_stats[2u * row + 1u]);
    let b = select(pz, a, j == cb_targets[row]);
    cb_dx[i] = b + sep(gs * m_exp(cb_logit(i) - m), z);
}
