// reduce.wgsl — reductions in the contract's fixed order (needs mathlib).
// One invocation per output runs its whole reduction serially, so the order is
// exactly the CPU reference's (ascending), whatever the grid.
// 1-D grids: i = grid_index(wg, groups, lane).

// ---- reduce: x: (outer, r, inner) -> y: (outer, inner) ----
// Sum: acc = -0.0 (the exact identity), acc = acc + x ascending.
// Max: acc = -inf, acc = maximum(acc, x) ascending (NaN wins, +0 over -0).
// One dispatch covers k in [k0, k1): the first starts from the identity, a
// later one from the running value it left in y. Lavapipe (llvmpipe) silently
// stops a shader after 65,535 loop iterations, so the host splits long
// reductions into such passes; the order of the additions is unchanged.

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
            var acc = bitcast<f32>(0xff800000u);
            if r_prm.k0 > 0u {
                acc = r_y[t];
            }
            for (var k = r_prm.k0; k < r_prm.k1; k++) {
                acc = maximum_c(acc, r_x[base + k * inner]);
            }
            r_y[t] = acc;
        }
        // unreachable: a test holds every generated R_* to a case here
        default: { r_y[t] = bitcast<f32>(QNAN); }
    }
}

// ---- softmax over rows: x: (rows, n) -> y: (rows, n) ----
// v = x * scale (x when scale is 1); causal: v = -inf for keys j > i = row mod n.
// m = max of v (the Max order), e = exp(v - m), s = Σ e ascending from -0, y = div(e, s).

struct RowsParams {
    rows: u32,
    n: u32,
    scale: u32,  // f32 bits; the backward multiplies dx by it
    causal: u32, // 1: mask the keys after the query position (forward only)
}

fn sm_value(x: f32, j: u32, i: u32) -> f32 {
    if s_prm.causal != 0u && j > i {
        return bitcast<f32>(0xff800000u);
    }
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
    let n = s_prm.n;
    let base = row * n;
    let i = row % n;
    var m = bitcast<f32>(0xff800000u);
    for (var j = 0u; j < n; j++) {
        m = maximum_c(m, sm_value(s_x[base + j], j, i));
    }
    var s = -0.0;
    for (var j = 0u; j < n; j++) {
        let e = m_exp(sm_value(s_x[base + j], j, i) - m);
        s_y[base + j] = e;
        s = s + e;
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
