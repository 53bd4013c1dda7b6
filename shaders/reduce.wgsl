// reduce.wgsl — reductions in the contract's fixed order (needs mathlib).
// One invocation per output runs its whole reduction serially, so the order is
// exactly the CPU reference's (ascending), whatever the grid.
// 1-D grids: i = grid_index(wg, groups, lane).

// ---- reduce: x: (outer, r, inner) -> y: (outer, inner) ----
// Sum: acc = -0.0 (the exact identity), acc = acc + x ascending.
// Max: acc = x[0], acc = maximum(acc, x) for k = 1.. ascending (NaN wins, +0
// over -0): it starts from a loaded value, never from a constant -inf (a
// compiler assuming no infinities may fold that); the same bits, since
// maximum(-inf, x) is x for every x. An empty max (r = 0) is -inf, stored as a
// bit pattern, no arithmetic on it.
// One dispatch covers k in [k0, k1): the first starts from the identity (the
// first element for Max), a later one from the running value it left in y.
// Lavapipe (llvmpipe) silently stops a shader after 65,535 loop iterations, so
// the host splits long reductions into such passes; the order of the additions
// is unchanged.

struct ReduceParams {
    outer: u32,
    r: u32,
    inner: u32,
    op: u32, // R_SUM or R_MAX (generated from ReduceOp::code)
    k0: u32,
    k1: u32,
}

@group(0) @binding(0) var<storage, read> r_prm: ReduceParams;
@group(0) @binding(1) var<storage, read> r_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> r_y: array<f32>;

@compute @workgroup_size(64)
fn reduce(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
          @builtin(local_invocation_index) lane: u32) {
    let t = grid_index(wg, groups, lane);
    let inner = r_prm.inner;
    if t >= r_prm.outer * inner {
        return;
    }
    let o = t / inner;
    let j = t % inner;
    let base = o * r_prm.r * inner + j;
    switch r_prm.op {
        case R_SUM: {
            var acc = -0.0;
            if r_prm.k0 > 0u {
                acc = r_y[t];
            }
            for (var k = r_prm.k0; k < r_prm.k1; k++) {
                acc = acc + r_x[base + k * inner];
            }
            r_y[t] = acc;
        }
        case R_MAX: {
            if r_prm.r == 0u {
                r_y[t] = bitcast<f32>(0xff800000u); // the empty max: -inf, as bits
                return;
            }
            var acc: f32;
            var k = r_prm.k0;
            if k > 0u {
                acc = r_y[t];
            } else {
                acc = r_x[base];
                k = 1u;
            }
            for (; k < r_prm.k1; k++) {
                acc = maximum_c(acc, r_x[base + k * inner]);
            }
            r_y[t] = acc;
        }
        // unreachable: a test holds every generated R_* to a case here
        default: { r_y[t] = bitcast<f32>(QNAN); }
    }
}

// ---- softmax over rows: x: (rows, n) -> y: (rows, n) ----
// v = x * scale (x when scale is 1). Causal: row r is query i = r mod n and
// only its keys j <= i are live (all n otherwise). m = v_0 (key 0 is always
// live), m = maximum(m, v_j) over the other live keys ascending;
// e_j = exp(v_j - m) for live keys, +0 for masked ones; s = -0, s = s + e_j
// over the live keys ascending; y = div(e, s).
// No constant -inf anywhere (a compiler assuming no infinities may fold
// arithmetic on one). This is bit for bit the former algorithm, where masked
// keys were v_j = -inf, m started from -inf and every key was summed:
// * maximum(-inf, v_0) = v_0 and maximum(m, -inf) = m, so m is the same;
// * a masked e_j was exp(-inf - m): +0 for a finite m; for a NaN or infinite
//   m (a NaN or +inf among the live keys, or all of them -inf) some live e is
//   NaN, so s is NaN and every y = div(e, s) is the quiet NaN whatever e_j is;
// * adding +0 changes nothing but a -0 sum, and s is never -0 after key 0
//   (-0 + e_0 is -0 only for e_0 = -0, which exp never returns): so the
//   masked keys, all after key 0, can be left out of the sum.

struct RowsParams {
    rows: u32,
    n: u32,
    scale: u32,  // f32 bits; the backward multiplies dx by it
    causal: u32, // 1: mask the keys after the query position (forward only)
}

fn sm_value(x: f32) -> f32 {
    let scale = bitcast<f32>(s_prm.scale);
    if scale != 1.0 {
        return x * scale;
    }
    return x;
}

@group(0) @binding(0) var<storage, read> s_prm: RowsParams;
@group(0) @binding(1) var<storage, read> s_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> s_y: array<f32>;

@compute @workgroup_size(64)
fn softmax_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                @builtin(local_invocation_index) lane: u32) {
    let row = grid_index(wg, groups, lane);
    if row >= s_prm.rows {
        return;
    }
    let n = s_prm.n; // >= 1: the host dispatches no empty rows
    let base = row * n;
    var live = n;
    if s_prm.causal != 0u {
        live = row % n + 1u;
    }
    var m = sm_value(s_x[base]);
    for (var j = 1u; j < live; j++) {
        m = maximum_c(m, sm_value(s_x[base + j]));
    }
    var s = -0.0;
    for (var j = 0u; j < live; j++) {
        let e = m_exp(sm_value(s_x[base + j]) - m);
        s_y[base + j] = e;
        s = s + e;
    }
    for (var j = live; j < n; j++) {
        s_y[base + j] = 0.0;
    }
    for (var j = 0u; j < n; j++) {
        s_y[base + j] = m_div(s_y[base + j], s);
    }
}

// ---- softmax backward from its output: y, g: (rows, n) -> dx: (rows, n) ----
// dot = Σ g·y ascending from -0 as fma_c(g, y, dot); dx = y · (g − dot).

@group(0) @binding(0) var<storage, read> sb_prm: RowsParams;
@group(0) @binding(1) var<storage, read> sb_y: array<f32>;
@group(0) @binding(2) var<storage, read> sb_g: array<f32>;
@group(0) @binding(3) var<storage, read_write> sb_dx: array<f32>;

@compute @workgroup_size(64)
fn softmax_rows_backward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                         @builtin(local_invocation_index) lane: u32) {
    let row = grid_index(wg, groups, lane);
    if row >= sb_prm.rows {
        return;
    }
    let n = sb_prm.n;
    let base = row * n;
    var dot = -0.0;
    for (var j = 0u; j < n; j++) {
        dot = fma_c(sb_g[base + j], sb_y[base + j], dot);
    }
    let scale = bitcast<f32>(sb_prm.scale);
    for (var j = 0u; j < n; j++) {
        var dx = sb_y[base + j] * (sb_g[base + j] - dot);
        if scale != 1.0 {
            dx = dx * scale;
        }
        sb_dx[base + j] = dx;
    }
}

// ---- chunked sum of squares: x: (n) -> partials[offset ..][.. ceil(n / chunk)] ----
// partial[c] = Σ_{i in chunk c} x_i² as fma_c(x, x, acc), ascending from -0
// (the host adds the partials in order: Storage::sum_squares).

struct ChunkParams {
    n: u32,
    chunk: u32,
    offset: u32, // where this buffer's partials start in the shared output
}

@group(0) @binding(0) var<storage, read> q_prm: ChunkParams;
@group(0) @binding(1) var<storage, read> q_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> q_out: array<f32>;

@compute @workgroup_size(64)
fn chunk_sum_squares(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                     @builtin(local_invocation_index) lane: u32) {
    let c = grid_index(wg, groups, lane);
    let n = q_prm.n;
    let start = c * q_prm.chunk;
    if start >= n {
        return;
    }
    let end = min(start + q_prm.chunk, n);
    var acc = -0.0;
    for (var i = start; i < end; i++) {
        let v = q_x[i];
        acc = fma_c(v, v, acc);
    }
    q_out[q_prm.offset + c] = acc;
}
