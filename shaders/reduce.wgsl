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

// ---- softmax, the hardware variant (backend/gpu/variant.rs): the same
// contract and bits, a workgroup per block of 64 rows ----
// Lane l owns row row0 + l and runs exactly its chain above (max, then sum,
// ascending) — but from workgroup memory: the block's rows are staged RW
// columns at a time with coalesced loads (consecutive lanes, consecutive
// columns of a row), each staged value already the chain's term. The outputs
// are elementwise given the row's statistics (kept in workgroup memory), so
// consecutive lanes write consecutive elements. exp is recomputed for the
// output rather than read back: the same function of the same bits.
// grid: grid1d(rows); 64 invocations per workgroup.

const RW: u32 = 16u;     // columns staged per step
const RPITCH: u32 = 17u; // a staged row's pitch (RW + 1: lanes folding different rows hit different banks)

var<workgroup> rows_tile: array<f32, 1088>; // (64 rows, RW columns), pitch RPITCH
var<workgroup> rows_tile2: array<f32, 1088>;
var<workgroup> row_m: array<f32, 64>;       // per row of the block: max (or dot)
var<workgroup> row_s: array<f32, 64>;       // per row: the sum

// Row `row`'s live keys (causal: the query's keys up to itself).
fn sm_live(row: u32) -> u32 {
    let n = s_prm.n;
    if s_prm.causal != 0u {
        return row % n + 1u;
    }
    return n;
}

// Stages columns [c0, c0 + RW) of the block's rows: step 0 the scaled values,
// step 1 the exponentials exp(v - m) (m from row_m); outside the matrix nothing.
fn sm_stage(row0: u32, lane: u32, c0: u32, step: u32) {
    let n = s_prm.n;
    for (var q = 0u; q < RW; q++) {
        let e = lane + 64u * q;
        let r = e / RW;
        let j = c0 + e % RW;
        if row0 + r < s_prm.rows && j < n {
            let v = sm_value(s_x[(row0 + r) * n + j]);
            if step == 0u {
                rows_tile[r * RPITCH + e % RW] = v;
            } else {
                rows_tile[r * RPITCH + e % RW] = m_exp(v - row_m[r]);
            }
        }
    }
}

@compute @workgroup_size(64)
fn softmax_rows_staged(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                       @builtin(local_invocation_index) lane: u32) {
    let row0 = grid_index(wg, groups, 0u); // uniform: loops with barriers depend on it only
    let rows = s_prm.rows;
    let n = s_prm.n; // >= 1
    let row = row0 + lane;
    let live = sm_live(row);
    // the columns any row of the block reads (causal: up to its last query)
    var hi = n;
    let last = min(row0 + 63u, rows - 1u);
    if s_prm.causal != 0u && row0 / n == last / n {
        hi = last % n + 1u;
    }
    var m = 0.0;
    for (var c0 = 0u; c0 < hi; c0 += RW) {
        workgroupBarrier();
        sm_stage(row0, lane, c0, 0u);
        workgroupBarrier();
        if row < rows {
            let w = min(RW, live - min(live, c0));
            for (var q = 0u; q < w; q++) {
                let v = rows_tile[lane * RPITCH + q];
                if c0 + q == 0u {
                    m = v;
                } else {
                    m = maximum_c(m, v);
                }
            }
        }
    }
    row_m[lane] = m;
    var s = -0.0;
    for (var c0 = 0u; c0 < hi; c0 += RW) {
        workgroupBarrier();
        sm_stage(row0, lane, c0, 1u);
        workgroupBarrier();
        if row < rows {
            let w = min(RW, live - min(live, c0));
            for (var q = 0u; q < w; q++) {
                s = s + rows_tile[lane * RPITCH + q];
            }
        }
    }
    row_s[lane] = s;
    workgroupBarrier();
    // y = div(e, s), e = +0 for masked keys: element e of the block
    let end = min(rows - row0, 64u) * n;
    for (var e = lane; e < end; e += 64u) {
        let r = e / n;
        let j = e % n;
        var ex = 0.0;
        if j < sm_live(row0 + r) {
            ex = m_exp(sm_value(s_x[row0 * n + e]) - row_m[r]);
        }
        s_y[row0 * n + e] = m_div(ex, row_s[r]);
    }
}

// Backward: lane l folds dot = Σ fma_c(g, y, dot) of its row from staged y
// and g, then dx = y · (g − dot) elementwise, coalesced.
@compute @workgroup_size(64)
fn softmax_rows_backward_staged(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
                                @builtin(local_invocation_index) lane: u32) {
    let row0 = grid_index(wg, groups, 0u);
    let rows = sb_prm.rows;
    let n = sb_prm.n;
    let row = row0 + lane;
    var dot = -0.0;
    for (var c0 = 0u; c0 < n; c0 += RW) {
        workgroupBarrier();
        for (var q = 0u; q < RW; q++) {
            let e = lane + 64u * q;
            let r = e / RW;
            let j = c0 + e % RW;
            if row0 + r < rows && j < n {
                rows_tile[r * RPITCH + e % RW] = sb_y[(row0 + r) * n + j];
                rows_tile2[r * RPITCH + e % RW] = sb_g[(row0 + r) * n + j];
            }
        }
        workgroupBarrier();
        if row < rows {
            let w = min(RW, n - c0);
            for (var q = 0u; q < w; q++) {
                dot = fma_c(rows_tile2[lane * RPITCH + q], rows_tile[lane * RPITCH + q], dot);
            }
        }
    }
    row_m[lane] = dot;
    workgroupBarrier();
    let scale = bitcast<f32>(sb_prm.scale);
    let end = min(rows - row0, 64u) * n;
    for (var e = lane; e < end; e += 64u) {
        let at = row0 * n + e;
        var dx = sb_y[at] * (sb_g[at] - row_m[e / n]);
        if scale != 1.0 {
            dx = dx * scale;
        }
        sb_dx[at] = dx;
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
